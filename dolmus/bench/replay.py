"""`dolmus replay`: one trace, several batching configurations, in-process, side by side.

Each configuration is a YAML file of EngineConfig fields plus optional `name` and
`tier_priorities` (the scheduler priority of each trace tier; default interactive=0,
batch=1; `tier_priorities: {}` turns tiers off), or instead `tiers`, in the tiers file's
format (`dolmus serve --tiers`), which also sets each tier's reservations, queue wait and
admission rule. The trace is replayed in real time (or
scaled by --speed) against an AsyncEngine on this process, and each request's latencies are
the engine's own timings (arrival to first token, token gaps, queue time).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dolmus.bench.dataset import BenchRequest, PromptMaker, load_trace
from dolmus.bench.loadgen import Load, RequestResult, run_load
from dolmus.bench.report import text_table, write_outputs
from dolmus.bench.stats import parse_slo, summarize, summarize_tiers
from dolmus.config import EngineConfig, TierSpec
from dolmus.config.server import PRIORITY_TIERS
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import parse_tiers, scheduling_specs

if TYPE_CHECKING:
    from dolmus.engine.async_engine import AsyncEngine

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass
class ReplayConfig:
    name: str
    engine: dict[str, Any]  # EngineConfig fields (model excepted: the command gives it)
    tier_priorities: dict[str, int]

    def engine_config(self, model: str | None) -> EngineConfig:
        return EngineConfig(**_engine_kwargs({**self.engine, "model": model}))

    def flags(self) -> str:
        """The `dolmus serve` flags that reproduce this configuration."""
        parts = []
        for key, value in self.engine.items():
            if key == "tier_specs":
                parts.append("--tiers FILE")  # the configuration's `tiers`, as a tiers file
                continue
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                parts.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                parts.append(f"{flag} {shlex.quote(str(value))}")
        return " ".join(parts)


def load_config(path: str | Path) -> ReplayConfig:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a configuration is a YAML mapping of engine settings")
    name = str(raw.pop("name", Path(path).stem))
    tiers = raw.pop("tier_priorities", dict(PRIORITY_TIERS))
    if "tiers" in raw:  # the tiers file's format: names, priorities and scheduling rules
        try:
            parsed = parse_tiers(raw.pop("tiers"))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        tiers = {name: t.priority for name, t in parsed.items()}
        specs = scheduling_specs(parsed)
        if specs:
            raw["tier_specs"] = [dataclasses.asdict(spec) for spec in specs]
    raw.pop("model", None)
    unknown = set(raw) - _ENGINE_FIELDS
    if unknown:
        raise ValueError(
            f"{path}: unknown settings {sorted(unknown)}; known: {sorted(_ENGINE_FIELDS - {'model'})}"
        )
    try:
        EngineConfig(**_engine_kwargs(raw))  # validate now, before any model is loaded
    except TypeError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return ReplayConfig(name, raw, {str(k): int(v) for k, v in (tiers or {}).items()})


def _engine_kwargs(engine: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig arguments from a configuration's plain (JSON-able) settings."""
    if "tier_specs" in engine:
        engine = {**engine, "tier_specs": tuple(TierSpec(**s) for s in engine["tier_specs"])}
    return engine


async def replay_engine(
    config: ReplayConfig, model: str | None, requests: list[BenchRequest], speed: float = 1.0
) -> tuple[list[RequestResult], float]:
    """Replay `requests` at their timestamps against a fresh engine built from `config`."""
    # the engine's modules only here: `dolmus` builds this command's parser on every start
    from dolmus.engine.async_engine import AsyncEngine
    from dolmus.engine.engine import Engine

    engine = AsyncEngine(await asyncio.to_thread(Engine, config.engine_config(model)))
    engine.start()
    counter = itertools.count()
    try:
        await _generate(engine, next(counter), BenchRequest([1, 2, 3, 4], 4), config)  # warm-up

        async def send(i: int, req: BenchRequest, t0: float) -> RequestResult:
            start = time.perf_counter()
            result = RequestResult(i, start - t0, ok=False, tier=req.tier, app=req.app)
            try:
                out = await _generate(engine, next(counter), req, config)
            except ValueError as exc:
                result.error = str(exc)
                return result
            c, m = out.outputs[0], out.outputs[0].metrics
            result.ok = True
            result.ttft, result.e2e, result.itl, result.queue_time = (
                m.ttft,
                m.e2e_latency,
                m.itl,
                m.queue_time,
            )
            result.prompt_tokens, result.output_tokens = len(out.prompt_token_ids), len(c.token_ids)
            return result

        return await run_load(send, requests, Load("trace", speed))
    finally:
        await engine.shutdown()
        gc.collect()  # the next configuration's KV cache needs this one's memory back


async def _generate(engine: AsyncEngine, n: int, req: BenchRequest, config: ReplayConfig) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
    priority = req.priority if req.priority is not None else config.tier_priorities.get(req.tier or "", 0)
    last = None
    async for out in engine.generate(f"replay-{n}", req.prompt, params, priority):
        last = out
    return last


def trace_requests(path: str, model: str | None) -> list[BenchRequest]:
    """The trace with made-up prompts as exact token ids (in-process, no re-tokenizing)."""
    from dolmus.engine.tokenizing import load_tokenizer

    tokenizer = load_tokenizer(str(EngineConfig(model=model).model_path))
    maker = PromptMaker(tokenizer)
    requests = load_trace(path, maker)
    for r in requests:
        if r.prompt_len is not None and isinstance(r.prompt, str):
            r.prompt = maker.ids(int(r.prompt_len))
    return requests


def run_configs(
    configs: list[ReplayConfig],
    model: str | None,
    requests: list[BenchRequest],
    speed: float,
    slo: dict[str, float],
    progress: bool = True,
) -> list[dict[str, Any]]:
    runs = []
    for i, config in enumerate(configs):
        if progress:
            print(f"replaying {len(requests)} requests on {config.name} ...", file=sys.stderr)
        results, duration = asyncio.run(replay_engine(config, model, requests, speed))
        runs.append(
            {
                "label": config.name,
                "x": i,
                "config": {**config.engine, "tier_priorities": config.tier_priorities},
                "flags": config.flags(),
                "summary": summarize(results, duration, slo),
                "tiers": summarize_tiers(results, duration, slo),
                "server": None,
                "requests": [r.to_json() for r in results],
            }
        )
    return runs


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="JSONL trace (timestamp, prompt or prompt_len, output_len, tier, app)")
    parser.add_argument("--model", default=None, help="model folder (default: built-in stories260k)")
    parser.add_argument("--configs", nargs="+", required=True, help="YAML files of engine settings")
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    parser.add_argument("--slo", default=None, help="e.g. ttft=0.5,tpot=0.05 (seconds) for goodput")
    parser.add_argument("--out", default=None, help="write results.json, report.md and PNG plots here")


def run_replay(args: argparse.Namespace) -> int:
    try:
        if args.speed <= 0:
            raise ValueError("--speed must be positive")
        configs = [load_config(p) for p in args.configs]
        slo = parse_slo(args.slo)
        requests = trace_requests(args.trace, args.model)
        runs = run_configs(configs, args.model, requests, args.speed, slo)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text_table(runs))
    if args.out:
        command = "dolmus " + " ".join(shlex.quote(a) for a in args.argv)
        files = write_outputs(args.out, "dolmus replay", command, runs, "configuration")
        print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
