"""`dolmus` command line: its subcommands and what each runs. The engine's flags, each mapping
onto one EngineConfig field, are in dolmus/engine_args.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from dolmus.bench.bench import add_bench_args, run_bench
from dolmus.bench.replay import add_replay_args, run_replay
from dolmus.bench.tune import add_tune_args, run_tune
from dolmus.config import EngineConfig
from dolmus.config.server import ServerConfig
from dolmus.engine_args import (
    add_engine_args,
    add_parallel_args,
    config_from_args,
    engine_config_from_args,
    field_choices,
)
from dolmus.entrypoints.chat_cli import add_chat_args, run_chat
from dolmus.evaluate.evaluate import add_eval_args, run_eval


def _generate(args: argparse.Namespace) -> int:
    from dolmus.engine.engine import Engine
    from dolmus.sampling_params import SamplingParams

    try:
        engine = Engine(engine_config_from_args(args), progress=True)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.sampling_seed,
            stop=args.stop or [],
        )
        prompts = args.prompts or ["Once upon a time"]
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    # All prompts run together; the terminal shows them one after another, each streamed
    # live once its turn comes (earlier text of a later prompt is printed in one go).
    pending: dict[str, list[str]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    order = [str(i) for i in range(len(prompts))]
    current = 0
    out = sys.stdout

    def show_header(i: int) -> None:
        if len(prompts) > 1:
            out.write(f"\n--- [{i}] ---\n" if i else f"--- [{i}] ---\n")
        out.write(prompts[i])

    show_header(0)
    while engine.has_unfinished_requests():
        for o in engine.step():
            pending[o.request_id].append(o.outputs[0].text_delta)
            if o.finished:
                finished.add(o.request_id)
        while current < len(order):
            rid = order[current]
            out.write("".join(pending[rid]))
            pending[rid].clear()
            if rid not in finished:
                break
            current += 1
            if current < len(order):
                show_header(current)
        out.flush()
    out.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from dolmus.server.access import AccessPolicy
    from dolmus.server.launcher import serve

    try:
        args.api_key = args.api_key or os.environ.get("DOLMUS_API_KEY") or None
        engine_config = engine_config_from_args(args)
        server_config = config_from_args(ServerConfig, args)
        server_config.load_chat_template()
        AccessPolicy.build(server_config.tiers, server_config.api_key)  # fail before loading a model
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(engine_config, server_config)


def _run_batch(args: argparse.Namespace) -> int:
    from dolmus.entrypoints.run_batch import run_batch_file

    try:
        engine_config = engine_config_from_args(args)
        template = ServerConfig(chat_template=args.chat_template).load_chat_template()
        ok, failed = asyncio.run(
            run_batch_file(engine_config, args.input, args.output, args.served_model_name, template)
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{ok} requests succeeded, {failed} failed; output in {args.output}", file=sys.stderr)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from dolmus.executor.remote_node import run_node

    if args.master_port is None:
        print("error: --master-port is needed (host 0's --master-port)", file=sys.stderr)
        return 2
    try:
        return run_node(
            args.master_addr,
            args.master_port,
            args.node_rank,
            args.nnodes,
            args.model,
            args.tensor_parallel_size,
            args.wait,
        )
    except (ValueError, TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _convert(args: argparse.Namespace) -> int:
    from dolmus.convert import convert_to_gguf

    try:
        out = convert_to_gguf(args.model, args.out, args.type)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients see (default: the folder's name, or the GGUF's file stem); the "
        "--model path is accepted in requests too",
    )
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or DOLMUS_API_KEY)")
    g.add_argument(
        "--tiers", default=None, help="YAML file of tiers and API keys, each with a tier and quotas"
    )
    g.add_argument("--chat-template", default=None, help="jinja2 chat template: a file or the template text")
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=field_choices(ServerConfig, "reasoning_parser"),
        help="split <think>...</think> of chat replies into reasoning_content (vLLM's names)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=field_choices(ServerConfig, "tool_call_parser"),
        help="the model's tool-call format under tool_choice auto (vLLM's names)",
    )
    g.add_argument("--max-waiting", type=int, default=None, help="answer 429 when more requests wait")
    g.add_argument("--max-n", type=int, default=d.max_n, help="answer 400 to a request with a larger n")
    g.add_argument(
        "--pooling",
        default=d.pooling,
        choices=field_choices(ServerConfig, "pooling"),
        help="embeddings' default pooling of final hidden states: the last token's, or the mean",
    )
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="answer 413 above this size")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout, help="seconds to drain on SIGTERM")
    g.add_argument(
        "--gpu-hour-cost", type=float, default=None, help="machine cost per hour, for cost metrics"
    )
    g.add_argument(
        "--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument(
        "--ui", action=argparse.BooleanOptionalAction, default=d.ui, help="the chat page at / (--no-ui: off)"
    )
    g.add_argument(
        "--allowed-origins",
        type=lambda text: tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip()),
        default=d.allowed_origins,
        help="comma-separated browser origins allowed to call the API (CORS), or '*'",
    )
    g.add_argument(
        "--engine-core",
        choices=field_choices(ServerConfig, "engine_core"),
        default=d.engine_core,
        help="process: the step loop in its own process; thread: in the API server's process",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=d.data_parallel_size,
        help="engine cores (model copies, each on its share of the cores or GPUs) behind this port",
    )
    g.add_argument(
        "--batch-dir",
        default=None,
        help="folder for Batch API files and jobs, resumed on restart (default: a temporary folder)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dolmus", description="LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts, streamed to the terminal")
    gen.add_argument("prompts", nargs="*", help='prompts (default: "Once upon a time")')
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(srv)
    _add_serve_args(srv)
    srv.set_defaults(func=_serve)

    batch = sub.add_parser("run-batch", help="answer a Batch API JSONL file offline (OpenAI's/vLLM's format)")
    batch.add_argument("-i", "--input", required=True, help="JSONL of {custom_id, method, url, body} lines")
    batch.add_argument("-o", "--output", required=True, help="JSONL of the answers, in input order")
    batch.add_argument("--served-model-name", default=None, help="the model name lines may give")
    batch.add_argument("--chat-template", default=None, help="jinja2 chat template: a file or the text")
    add_engine_args(batch)
    batch.set_defaults(func=_run_batch)

    worker = sub.add_parser(
        "worker",
        help="run this host's tensor-parallel ranks for an engine on host 0 (`serve --nnodes N`)",
    )
    d = EngineConfig()
    g = worker.add_argument_group("distributed")
    g.add_argument("--model", default=None, help="the model's folder on this host (default: host 0's path)")
    add_parallel_args(g, d)
    g.add_argument("--wait", type=float, default=600.0, help="seconds to wait for host 0's engine")
    worker.set_defaults(func=_worker, tensor_parallel_size=None)  # None: host 0's, unchecked

    # No abbreviated flags: chat passes its engine flags on to `dolmus serve` as written.
    chat = sub.add_parser("chat", help="chat with a model in the terminal", allow_abbrev=False)
    add_chat_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat)

    conv = sub.add_parser("convert", help="write a Hugging Face folder as a GGUF file for llama.cpp")
    conv.add_argument("model", help="Hugging Face model folder")
    conv.add_argument("--to", choices=["gguf"], default="gguf")
    conv.add_argument("--out", required=True, help="the .gguf file to write")
    conv.add_argument("--type", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
    conv.set_defaults(func=_convert)

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server and report latencies")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)

    replay = sub.add_parser("replay", help="replay a trace on in-process engines with several configurations")
    add_replay_args(replay)
    replay.set_defaults(func=run_replay)

    tune = sub.add_parser("tune", help="search batching settings for the best goodput on a trace")
    add_tune_args(tune)
    tune.set_defaults(func=run_tune)

    ev = sub.add_parser("eval", help="score a model and its variants on your own JSONL task file")
    add_engine_args(ev)
    add_eval_args(ev)
    ev.set_defaults(func=lambda a: run_eval(a, engine_config_from_args(a)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # for reports that quote their command
    level = logging.INFO if args.command in ("serve", "worker") else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
