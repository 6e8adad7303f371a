"""`dolmus tune`: find batching settings with the best goodput on your own trace.

The search is coordinate ascent over the settings that shape batching: first
max_num_seqs (step token budget held), then max_num_batched_tokens (the best seat count
held), then, when the trace has both tiers, the interactive tier's reserved share of seats
and step tokens (batch borrows it while interactive is idle), each trial a real in-process
replay of the whole trace. The default configuration
is always tried first, so the recommendation's goodput is never below the default's as
measured in the same session. Trials stop when the next one would overrun --budget-minutes
(estimated from the slowest trial so far).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from typing import Any

from dolmus.bench.dataset import BenchRequest
from dolmus.bench.replay import ReplayConfig, run_configs, trace_requests
from dolmus.bench.report import text_table, write_outputs
from dolmus.bench.stats import parse_slo
from dolmus.config import EngineConfig, TierSpec
from dolmus.config.server import PRIORITY_TIERS

SEATS = (8, 16, 32, 64, 128, 256)
# A trial must beat the best so far by this share of goodput to replace it: smaller gaps are
# within run-to-run noise, and the default (tried first) should not lose to noise.
MIN_GAIN = 0.03
STEP_TOKENS = (128, 256, 512, 1024, 2048)
RESERVES = (0.1, 0.25, 0.5)  # the interactive tier's share of seats and step tokens


def reservation(share: float) -> dict[str, Any]:
    """Engine settings reserving `share` of seats and step tokens for the interactive tier."""
    if not share:
        return {}
    interactive, batch = PRIORITY_TIERS["interactive"], PRIORITY_TIERS["batch"]
    specs = [
        dataclasses.asdict(TierSpec(interactive, reserved_seats=share, reserved_tokens=share)),
        dataclasses.asdict(TierSpec(batch)),
    ]
    return {"tier_specs": specs}


def _better(run: dict[str, Any], best: dict[str, Any]) -> bool:
    new, old = run["summary"], best["summary"]
    if new["goodput"] != old["goodput"]:
        return new["goodput"] > old["goodput"] * (1 + MIN_GAIN)
    return new["output_throughput"] > old["output_throughput"] * (1 + MIN_GAIN)


def tune(
    model: str | None,
    requests: list[BenchRequest],
    slo: dict[str, float],
    budget_s: float,
    speed: float = 1.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Trials in order, the default's run and the best run, and the time spent."""
    start = time.monotonic()
    default = EngineConfig(model=model)
    seats0 = default.max_num_seqs
    tokens0 = default.resolve_batched_tokens(default.resolve_device())
    trials: list[dict[str, Any]] = []
    tried: dict[tuple[int, int, float], dict[str, Any]] = {}
    slowest = 0.0

    def trial(seats: int, tokens: int, reserve: float) -> dict[str, Any] | None:
        nonlocal slowest
        key = (seats, tokens, reserve)
        if key in tried:
            return tried[key]
        spent = time.monotonic() - start
        if trials and spent + slowest > budget_s:
            return None
        name = "default" if key == (seats0, tokens0, 0.0) else f"seqs={seats},tokens={tokens}"
        if reserve:
            name += f",reserve={reserve:g}"
        settings = {"max_num_seqs": seats, "max_num_batched_tokens": tokens, **reservation(reserve)}
        config = ReplayConfig(name, settings, dict(PRIORITY_TIERS))
        t = time.monotonic()
        run = run_configs([config], model, requests, speed, slo, progress)[0]
        slowest = max(slowest, time.monotonic() - t)
        run["x"] = len(trials)
        trials.append(run)
        tried[key] = run
        return run

    best_key = (seats0, tokens0, 0.0)
    best = trial(*best_key)
    assert best is not None
    tiers = {r.tier for r in requests if r.tier is not None}
    axes = [("seats", SEATS), ("tokens", STEP_TOKENS)]
    if {"interactive", "batch"} <= tiers:
        axes.append(("reserve", RESERVES))
    for axis, values in axes:
        for v in values:
            at = {"seats": 0, "tokens": 1, "reserve": 2}[axis]
            key = (*best_key[:at], v, *best_key[at + 1 :])
            run = trial(*key)
            if run is None:
                break
            if _better(run, best):
                best, best_key = run, key
    return {
        "trials": trials,
        "default": trials[0],
        "best": best,
        "best_settings": {
            "max_num_seqs": best_key[0],
            "max_num_batched_tokens": best_key[1],
            "interactive_reserved_share": best_key[2],
        },
        "elapsed_s": time.monotonic() - start,
        "budget_s": budget_s,
    }


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="JSONL trace (timestamp, prompt or prompt_len, output_len, tier, app)")
    parser.add_argument("--model", default=None, help="model folder (default: built-in stories260k)")
    parser.add_argument(
        "--slo", required=True, help="e.g. ttft=0.5,tpot=0.05 (seconds): goodput counts these"
    )
    parser.add_argument("--budget-minutes", type=float, default=10.0)
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    parser.add_argument("--out", default=None, help="write results.json, report.md and PNG plots here")


def run_tune(args: argparse.Namespace) -> int:
    try:
        if args.budget_minutes <= 0 or args.speed <= 0:
            raise ValueError("--budget-minutes and --speed must be positive")
        slo = parse_slo(args.slo)
        if not slo:
            raise ValueError("--slo needs at least one bound, e.g. ttft=0.5")
        requests = trace_requests(args.trace, args.model)
        result = tune(args.model, requests, slo, args.budget_minutes * 60, args.speed)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text_table(result["trials"]))
    best, default = result["best"]["summary"], result["default"]["summary"]
    settings = result["best_settings"]
    flags = (
        f"--max-num-seqs {settings['max_num_seqs']} "
        f"--max-num-batched-tokens {settings['max_num_batched_tokens']}"
    )
    model = f" --model {shlex.quote(args.model)}" if args.model else ""
    share = settings["interactive_reserved_share"]
    if share:
        flags += " --tiers FILE"
    print(
        f"\n{len(result['trials'])} trials in {result['elapsed_s']:.0f} s "
        f"(budget {result['budget_s']:.0f} s)\n"
        f"recommended: {flags}\n"
        f"goodput {best['goodput']:.3f} req/s ({100 * best['goodput_share']:.0f}% within SLO) vs default "
        f"{default['goodput']:.3f} req/s ({100 * default['goodput_share']:.0f}%)\n"
        f"serve with: dolmus serve{model} {flags}"
    )
    if share:
        print(
            "with FILE holding:\n"
            "tiers:\n"
            f"  interactive: {{priority: 0, reserved_seats: {share:g}, reserved_tokens: {share:g}}}\n"
            "  batch: {priority: 1}"
        )
    if args.out:
        command = "dolmus " + " ".join(shlex.quote(a) for a in args.argv)
        files = write_outputs(args.out, "dolmus tune", command, result["trials"], "trial")
        summary = {k: v for k, v in result.items() if k not in ("trials", "default", "best")}
        (files[0].parent / "recommendation.json").write_text(
            json.dumps({**summary, "best": result["best"]["label"], "flags": flags}, indent=1)
        )
        print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
