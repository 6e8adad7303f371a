"""`dolmus bench`: load-test any OpenAI-compatible server (or one it starts) and report.

One run per load value (a sweep of concurrency, rate, burst size or trace speed); each run
reads the server's /metrics before and after, so the report also carries the server's own
account (prefix-cache hit rate, mean latencies, cost per token) where it exposes one.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx

from dolmus.bench.dataset import BenchRequest, LengthDist, PromptMaker, load_sharegpt, load_trace, synthetic
from dolmus.bench.loadgen import CompletionsClient, Load, RequestResult, run_load, validate_load
from dolmus.bench.report import text_table, write_outputs
from dolmus.bench.server_metrics import run_delta, scrape_all
from dolmus.bench.spawn import ServerProcess
from dolmus.bench.stats import parse_slo, summarize, summarize_tiers
from dolmus.config import DEFAULT_MODEL_DIR


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", default="synthetic", help="synthetic | sharegpt:FILE | trace:FILE")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--input-len", default="128", help="prompt tokens: N or A:B (uniform)")
    g.add_argument("--output-len", default="128", help="output tokens: N or A:B (uniform)")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix shared by requests")
    g.add_argument(
        "--shared-prefix-ratio", type=float, default=1.0, help="share of requests with that prefix"
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder for synthetic prompts")
    g.add_argument("--seed", type=int, default=0)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root or /v1 URL (omit with --serve-args)")
    parser.add_argument("--serve-args", default=None, help="start `dolmus serve ARGS` and benchmark it")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        help="server whose /metrics is read before and after each run (default: --base-url); "
        "repeat it for every replica behind a router, whose counters are added up",
    )
    add_dataset_args(parser)
    g = parser.add_argument_group("load (one kind; a comma list sweeps)")
    g.add_argument("--concurrency", default=None, help="requests in flight, e.g. 1,4,16 (default 8)")
    g.add_argument("--rate", default=None, help="Poisson arrivals per second, e.g. 1,2,4")
    g.add_argument("--burst", default=None, help="SIZE:INTERVAL, e.g. 16:5 (16 requests every 5 s)")
    g.add_argument("--speed", default=None, help="trace replay speed factors, e.g. 1,2 (trace datasets)")
    parser.add_argument("--slo", default=None, help="e.g. ttft=0.5,tpot=0.05 (seconds) for goodput")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let EOS end a request early (default: always make output-len tokens)",
    )
    parser.add_argument(
        "--extra-body",
        default=None,
        help='JSON merged into every request, e.g. \'{"logit_bias": {"2": -100}}\'',
    )
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    parser.add_argument("--out", default=None, help="write results.json, report.md and PNG plots here")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def loads_from_args(args: argparse.Namespace, is_trace: bool) -> tuple[list[Load], str]:
    """The sweep and the x-axis label of its plots."""
    given = [k for k in ("concurrency", "rate", "burst", "speed") if getattr(args, k)]
    if len(given) > 1:
        raise ValueError(f"choose one of --concurrency, --rate, --burst, --speed (got {', '.join(given)})")
    kind = given[0] if given else ("speed" if is_trace else "concurrency")
    if kind == "speed" and not is_trace:
        raise ValueError("--speed replays a trace: use --dataset trace:FILE")
    raw = getattr(args, kind) or ("1" if kind == "speed" else "8")
    loads = []
    for item in str(raw).split(","):
        try:
            if kind == "burst":
                size, _, interval = item.partition(":")
                loads.append(Load("burst", float(size), float(interval or 1.0)))
            else:
                loads.append(Load("trace" if kind == "speed" else kind, float(item)))
        except ValueError:
            raise ValueError(f"--{kind}: {item!r} is not a number") from None
    labels = {
        "concurrency": "concurrency",
        "rate": "request rate (req/s)",
        "burst": "burst size",
        "speed": "trace speed",
    }
    return [validate_load(x) for x in loads], labels[kind]


def load_requests(
    args: argparse.Namespace, default_tokenizer: str | None = None, run_index: int = 0
) -> list[BenchRequest]:
    """The run's requests. Synthetic prompts are fresh for each run of a sweep (seed + run
    index), so a later run is not served from the prefix cache warmed by an earlier one."""
    kind, _, path = args.dataset.partition(":")
    if kind == "sharegpt":
        return load_sharegpt(path, args.num_requests, args.seed)
    maker = PromptMaker(_tokenizer(args.tokenizer or default_tokenizer), args.seed + run_index)
    if kind == "trace":
        return load_trace(path, maker)
    if kind != "synthetic":
        raise ValueError(f"--dataset must be synthetic, sharegpt:FILE or trace:FILE, got {args.dataset!r}")
    return synthetic(
        maker,
        args.num_requests,
        LengthDist.parse(args.input_len),
        LengthDist.parse(args.output_len),
        args.seed,
        args.shared_prefix_len,
        args.shared_prefix_ratio,
    )


def _tokenizer(path: str | None) -> Any:
    from dolmus.engine.tokenizing import load_tokenizer

    folder = path if path and Path(path).is_dir() else str(DEFAULT_MODEL_DIR)
    return load_tokenizer(folder)


async def _bench(args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    root = base_url.rstrip("/").removesuffix("/v1")
    api = root + "/v1"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    loads, _ = loads_from_args(args, args.dataset.startswith("trace:"))
    slo = parse_slo(args.slo)
    metric_roots = [u.rstrip("/").removesuffix("/v1") for u in args.metrics_url or [root]]
    runs = []
    async with httpx.AsyncClient(headers=headers) as http:
        model = args.model or await _first_model(http, api)
        client = CompletionsClient(
            api, model, args.api_key, args.ignore_eos, args.temperature, _extra_body(args)
        )
        try:
            for i in range(args.warmup):
                await client.send(-1, BenchRequest(f"Warm-up request {i}.", 8), 0.0)
            for i, load in enumerate(loads):
                requests = load_requests(args, model, run_index=i)
                # Out of the collector's sight, as the servers do with theirs: this process holds
                # 190k-380k objects (PyTorch, the tokenizer's libraries), and a full collection of
                # them took 70-200 ms here (one ran as a run's results were gathered). Inside a
                # run it would hold up reading the streams in flight, a TTFT or ITL outlier
                # charged to the server under test.
                gc.collect()
                gc.freeze()
                before = await scrape_all(http, metric_roots)
                results, duration = await _run_with_progress(client, requests, load, args)
                after = await scrape_all(http, metric_roots)
                runs.append(make_run(load, results, duration, slo, run_delta(before, after)))
        finally:
            await client.close()
    return runs


def make_run(
    load: Load,
    results: list[RequestResult],
    duration: float,
    slo: dict[str, float],
    server: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "label": load.label,
        "x": load.value,
        "summary": summarize(results, duration, slo),
        "tiers": summarize_tiers(results, duration, slo),
        "server": server,
        "requests": [r.to_json() for r in results],
    }


async def _run_with_progress(
    client: CompletionsClient, requests: list[BenchRequest], load: Load, args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm

    with tqdm(
        total=len(requests), desc=load.label, unit="req", disable=not args.progress, file=sys.stderr
    ) as bar:
        return await run_load(client.send, requests, load, args.seed, on_done=lambda _: bar.update(1))


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    if not args.extra_body:
        return {}
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return extra


async def _first_model(http: httpx.AsyncClient, api: str) -> str:
    response = await http.get(api + "/models", timeout=30)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{api}/models lists no model: pass --model")
    return data[0]["id"]


def run_bench(args: argparse.Namespace) -> int:
    if bool(args.base_url) == bool(args.serve_args):
        print("error: give exactly one of --base-url and --serve-args", file=sys.stderr)
        return 2
    server = None
    try:
        if args.serve_args:
            print(f"starting: dolmus serve {args.serve_args}", file=sys.stderr)
            server = ServerProcess(*shlex.split(args.serve_args))
        runs = asyncio.run(_bench(args, server.url if server else args.base_url))
    except (ValueError, OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
    print(text_table(runs))
    if args.out:
        x_label = loads_from_args(args, args.dataset.startswith("trace:"))[1]
        command = "dolmus " + " ".join(shlex.quote(a) for a in args.argv)
        files = write_outputs(args.out, "dolmus bench", command, runs, x_label)
        print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
