"""`dolmus eval`: quality of one model (A) and its variants on the user's own task file.

`--compare` spelling: `PATH[@QUANT]`, or `@QUANT` alone for A's model with another
`--quantization` (e.g. `--compare @int8`). Models run one after another, each freed before the
next loads. Reported per model: accuracy with a 95% Wilson interval, agreement with A (same
answer text), mean reference log-likelihood, and "delta_ll": the mean over reference tokens of
(A's log-likelihood - this model's), a per-token KL-style gap computed only from the reference
tokens' log-probs (not full-distribution KL), and only where both share A's tokenizer (same ids).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from dolmus.bench.report import _save
from dolmus.config import EngineConfig
from dolmus.evaluate.tasks import load_tasks, wilson


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", required=True, help="JSONL task file")
    parser.add_argument("--compare", action="append", default=[], help="PATH[@QUANT] or @QUANT (A's model)")
    parser.add_argument("--out", default=None, help="folder for eval.json and eval.png")


def _spec_config(base: EngineConfig, spec: str) -> EngineConfig:
    path, _, quant = spec.partition("@")
    changes: dict[str, Any] = {}
    if path:
        changes["model"] = path
    if quant:
        changes["quantization"] = None if quant == "none" else quant
    return dataclasses.replace(base, **changes)


def _summary(name: str, tasks: list[Any], r: dict[str, Any], a: dict[str, Any] | None) -> dict[str, Any]:
    n, k = len(tasks), sum(r["correct"])
    lls = [x for row in r["ref_logprobs"] for x in row]
    s: dict[str, Any] = {
        "name": name,
        "accuracy": k / n,
        "ci95": list(wilson(k, n)),
        "mean_ref_logprob": sum(lls) / len(lls) if lls else None,
        "tokens_per_s": r["tokens_per_s"],
        "weight_bytes": r["weight_bytes"],
        "per_task": [
            {"id": t.id, "answer": ans, "correct": c, "ref_logprobs": ll}
            for t, ans, c, ll in zip(tasks, r["answers"], r["correct"], r["ref_logprobs"])
        ],
    }
    if a is not None:
        s["agreement"] = sum(x == y for x, y in zip(a["answers"], r["answers"])) / n
        pairs = [
            (x, y)
            for ra, rb in zip(a["ref_logprobs"], r["ref_logprobs"])
            if len(ra) == len(rb)  # same tokenization of the reference
            for x, y in zip(ra, rb)
        ]
        s["delta_ll"] = sum(x - y for x, y in pairs) / len(pairs) if pairs else None
    return s


def markdown(models: list[dict[str, Any]]) -> str:
    lines = [
        "| model | accuracy (95% CI) | agreement with A | mean ref log-lik | Δ log-lik vs A "
        "| tok/s | weights MiB |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    for m in models:
        lo, hi = m["ci95"]
        lines.append(
            f"| {m['name']} | {m['accuracy']:.2f} ({lo:.2f}-{hi:.2f}) | {f(m.get('agreement'), '{:.2f}')} "
            f"| {f(m['mean_ref_logprob'])} | {f(m.get('delta_ll'))} | {m['tokens_per_s']:.0f} "
            f"| {m['weight_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def _plot(path: Path, models: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [m["name"] for m in models]
    acc = [m["accuracy"] for m in models]
    err = [[a - m["ci95"][0] for a, m in zip(acc, models)], [m["ci95"][1] - a for a, m in zip(acc, models)]]
    ax.bar(names, acc, yerr=err, capsize=4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (95% Wilson CI)")
    return _save(fig, path)


def run_eval(args: argparse.Namespace, base: EngineConfig) -> int:
    from dolmus.evaluate.runner import run_model  # the engine: not on every `dolmus` start

    tasks = load_tasks(args.tasks)
    specs = [("A", base)] + [(s, _spec_config(base, s)) for s in args.compare]
    results, models = [], []
    for name, cfg in specs:
        r = run_model(cfg, tasks)
        results.append(r)
        label = name if name != "A" else f"A ({cfg.model or 'built-in'}, {cfg.quantization or 'as stored'})"
        models.append(_summary(label, tasks, r, results[0] if results[1:] else None))
    print(markdown(models))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps({"tasks": args.tasks, "models": models}, indent=2))
        _plot(out / "eval.png", models)
    return 0
