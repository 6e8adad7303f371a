"""`dolmus` command line. Each engine flag maps onto one EngineConfig field."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from dolmus.bench.bench import add_bench_args, run_bench
from dolmus.bench.replay import add_replay_args, run_replay
from dolmus.bench.tune import add_tune_args, run_tune
from dolmus.config import (
    SPECULATIVE_METHODS,
    SPECULATIVE_MODEL_METHODS,
    EngineConfig,
    SpeculativeConfig,
    TierSpec,
)
from dolmus.config.kv import KVEventsConfig, KVTransferConfig
from dolmus.config.server import ServerConfig
from dolmus.entrypoints.chat_cli import add_chat_args, run_chat
from dolmus.evaluate.evaluate import add_eval_args, run_eval

T = TypeVar("T")


def _kv_memory(text: str) -> float | int:
    value = float(text)
    return value if value <= 1 else int(value)


def _choices(cls: type, name: str) -> list:
    """A field's declared choices (dolmus/config/), in the CLI's spelling (`None` is left out: no flag)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[name]
    return [c for c in meta["choices"] if c is not None]


def _tier_specs(text: str) -> tuple[TierSpec, ...]:
    """`--tier-specs '[{"priority": 0, "reserved_seats": 0.25}, {"priority": 1}]'`."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
            raise ValueError("a JSON list of objects")
        return tuple(TierSpec(**t) for t in raw)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"tier specs: {exc}") from None


def _json_object(text: str, what: str, build: Callable[[dict], T]) -> T:
    """A flag's JSON object, built into its config class; argparse's error naming `what`."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a JSON object")
        return build(raw)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{what}: {exc}") from None


def _speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` (vLLM's keys)."""
    return _json_object(text, "speculative config", SpeculativeConfig.from_dict)


def _kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'` (vLLM's keys)."""
    return _json_object(text, "kv events config", KVEventsConfig.from_dict)


def _kv_transfer_config(text: str) -> KVTransferConfig:
    """`--kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14579}'` (vLLM's keys)."""
    return _json_object(text, "kv transfer config", KVTransferConfig.from_dict)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model folder (default: built-in stories260k)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=_choices(EngineConfig, "dtype"))
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda[:N]")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument(
        "--kv-cache-memory",
        type=_kv_memory,
        default=None,
        help="KV cache budget: bytes, or a fraction (<=1) of free memory (default: 4 GiB on CPU)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="step token budget (default: 512 on CPU, 2048 on GPU and where all linears run our tile kernel)",
    )
    g.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="inter-token latency target: while streams decode, a step takes only the prompt tokens "
        "its measured cost fits within it (default: none, the token budget alone)",
    )
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    g.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=d.prepack_weights)
    g.add_argument(
        "--quantization",
        choices=_choices(EngineConfig, "quantization"),
        default=d.quantization,
        help="on load: int8/int4 weight-only, w8a8 (int8 activations too), fp8 (CUDA only)",
    )
    g.add_argument(
        "--quant-group-size",
        type=int,
        default=d.quant_group_size,
        choices=_choices(EngineConfig, "quant_group_size"),
        help="int4: inputs per scale",
    )
    g.add_argument("--quant-symmetric", action="store_true", help="int4 without zero points")
    g.add_argument(
        "--kv-cache-dtype",
        choices=_choices(EngineConfig, "kv_cache_dtype"),
        default=d.kv_cache_dtype,
        help="KV cache storage: the model dtype, or int8/fp8 with a scale per token and head",
    )
    g.add_argument(
        "--quant-lm-head",
        choices=_choices(EngineConfig, "quant_lm_head"),
        default=d.quant_lm_head,
        help="int4: head format",
    )
    g.add_argument(
        "--gguf-activations",
        choices=_choices(EngineConfig, "gguf_activations"),
        default=d.gguf_activations,
        help="GGUF blocks on the AVX2 kernels (float32 runs): int8 rounds x to int8 per block of 32 "
        "at decode (8-bit blocks up to 8 sequences, 4-bit ones at one), as llama.cpp does: faster, "
        "a little less accurate",
    )
    g.add_argument(
        "--attention-backend",
        choices=_choices(EngineConfig, "attention_backend"),
        default=d.attention_backend,
        help="torch (gather + SDPA), native (our C decode kernel; bf16 on AVX-512 BF16 CPUs) or "
        "triton (our paged kernel; CUDA); auto: native or triton where they run, else torch",
    )
    g.add_argument(
        "--structured-output-backend",
        choices=_choices(EngineConfig, "structured_output_backend"),
        default=d.structured_output_backend,
        help="grammar library: xgrammar (fastest masks; the xgrammar extra) or llguidance (a plain "
        "install's); auto picks xgrammar where installed",
    )
    g.add_argument(
        "--executor",
        "--distributed-executor-backend",
        dest="executor",
        choices=_choices(EngineConfig, "executor"),
        default=d.executor,
        help="uni: the model in the engine's process; mp: in worker processes (tensor parallelism: always)",
    )
    add_parallel_args(g, d)
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=d.enable_expert_parallel,
        help="Mixture-of-Experts layers: whole experts on each tensor-parallel rank (num_experts / "
        "--tensor-parallel-size each) instead of a slice of every expert",
    )
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=d.distributed_timeout,
        help="seconds a rank may take to answer a step before the engine fails",
    )
    g.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=d.native_kernels,
        help="our C kernels on CPU (else PyTorch's and oneDNN's): AMX tiles for bf16 linears, AVX-512 ones "
        "for bf16 (int8/int4, RMSNorm, decode attention), AVX2 ones for GGUF's block types as stored",
    )
    g.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=d.fused_decode,
        help="decode-only steps as one call into our C kernels where the whole model runs on them "
        "(the same tokens; no per-layer Python and PyTorch glue)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="CUDA: run every step eagerly instead of replaying CUDA graphs for decode steps",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d.async_scheduling,
        help="launch each step before the last one's tokens reach the host, so appending, stop "
        "checks and detokenizing overlap the device's work (default: on for CUDA)",
    )
    g.add_argument(
        "--tier-specs",
        type=_tier_specs,
        default=d.tier_specs,
        help="JSON list of scheduling tiers (priority, reserved_seats/kv/tokens, max_queue_wait, "
        "ttft_target, admission); `serve --tiers FILE` sets them from the tiers file",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=d.speculative_config,
        help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": null}; methods '
        f'{", ".join(SPECULATIVE_METHODS)}; {", ".join(SPECULATIVE_MODEL_METHODS)} take "model": the '
        "draft model's, EAGLE-3 head's or Medusa heads' folder",
    )
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=d.kv_events_config,
        help="KV cache events for cache-aware routers as JSON, vLLM's keys: "
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558", "topic": "kv-events"} (also publisher, buffer_steps, hwm, max_queue_size; '
        "ours: bind)",
    )
    g.add_argument(
        "--kv-offload",
        default=d.kv_offload,
        help="a KV tier below the cache that keeps evicted prefixes and preempted requests' work: "
        "cpu (host RAM), disk:PATH (survives restarts) or mooncake:HOST:PORT (a Mooncake Store shared "
        "by every engine that names this master; name it by an address the other hosts reach)",
    )
    g.add_argument(
        "--kv-offload-size",
        type=float,
        default=d.kv_offload_size,
        help="the tier's size in GiB (mooncake: the host memory this engine adds to the store)",
    )
    g.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        default=d.kv_transfer_config,
        help="disaggregated prefill/decode as JSON, vLLM's keys: "
        '{"kv_role": "kv_producer"|"kv_consumer"|"kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579, '
        '"kv_buffer_size": 1e9, "kv_load_failure_policy": "fail"|"recompute", "kv_transfer_timeout": 30}',
    )


def add_parallel_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Tensor parallelism and where its ranks meet (shared by `serve` and `worker`)."""
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks each holding a share of every layer (torch.distributed)",
    )
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the ranks span")
    g.add_argument("--node-rank", type=int, default=d.node_rank, help="this host's index (0 runs the engine)")
    g.add_argument("--master-addr", default=d.master_addr, help="host 0's address, reachable from every host")
    g.add_argument(
        "--master-port",
        type=int,
        default=d.master_port,
        help="torch.distributed's rendezvous port on host 0 (the engine's control channel: port + 1)",
    )


def _config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass `cls` with every field that has a flag of the same name."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return _config_from_args(EngineConfig, args)


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
        server_config = _config_from_args(ServerConfig, args)
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
        choices=_choices(ServerConfig, "reasoning_parser"),
        help="split <think>...</think> of chat replies into reasoning_content (vLLM's names)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=_choices(ServerConfig, "tool_call_parser"),
        help="the model's tool-call format under tool_choice auto (vLLM's names)",
    )
    g.add_argument("--max-waiting", type=int, default=None, help="answer 429 when more requests wait")
    g.add_argument("--max-n", type=int, default=d.max_n, help="answer 400 to a request with a larger n")
    g.add_argument(
        "--pooling",
        default=d.pooling,
        choices=_choices(ServerConfig, "pooling"),
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
        choices=_choices(ServerConfig, "engine_core"),
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
