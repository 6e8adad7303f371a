"""Reports of benchmark runs: a terminal/Markdown table, results.json and PNG plots.

A "run" here is one dict: {"label", "x" (the load value, for plots), "summary",
"tiers" (per-tier summaries), "server" (its /metrics account or None), "requests"}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COLUMNS = (
    ("run", lambda s: s["label"]),
    ("ok/err", lambda s: f"{s['completed']}/{s['errors']}"),
    ("req/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("out tok/s", lambda s: f"{s['output_throughput']:.1f}"),
    ("TTFT p50/p99 ms", lambda s: _pair(s["ttft"])),
    ("TPOT p50/p99 ms", lambda s: _pair(s["tpot"])),
    ("ITL p50/p99 ms", lambda s: _pair(s["itl"])),
    ("E2E p50/p99 s", lambda s: _pair(s["e2e"], 1.0, "{:.2f}")),
    ("goodput req/s (share)", lambda s: f"{s['goodput']:.2f} ({100 * s['goodput_share']:.0f}%)"),
)


def _pair(dist: dict[str, float | None], scale: float = 1000.0, fmt: str = "{:.0f}") -> str:
    if dist["p50"] is None:
        return "-"
    return f"{fmt.format(dist['p50'] * scale)} / {fmt.format(dist['p99'] * scale)}"


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """One row per run, then one per tier of each run that has tiers."""
    rows = []
    for run in runs:
        rows.append([fn({**run["summary"], "label": run["label"]}) for _, fn in _COLUMNS])
        for tier, summary in run.get("tiers", {}).items():
            rows.append([fn({**summary, "label": f"  {run['label']} [{tier}]"}) for _, fn in _COLUMNS])
    return rows


def text_table(runs: list[dict[str, Any]]) -> str:
    header = [name for name, _ in _COLUMNS]
    rows = table_rows(runs)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for run in runs:
        server = run.get("server")
        if server:
            lines.append(f"{run['label']}: server says {_server_line(server)}")
    return "\n".join(lines)


def markdown_table(runs: list[dict[str, Any]]) -> str:
    header = [name for name, _ in _COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs)]
    return "\n".join(lines)


def _server_line(server: dict[str, Any]) -> str:
    parts = []
    if "prefix_cache_hit_rate" in server:
        parts.append(f"prefix cache hit rate {100 * server['prefix_cache_hit_rate']:.1f}%")
    for key, name in (("mean_ttft", "TTFT"), ("mean_tpot", "TPOT"), ("mean_queue_time", "queue")):
        if key in server:
            parts.append(f"mean {name} {1000 * server[key]:.0f} ms")
    if "spec_acceptance_rate" in server:
        parts.append(
            f"draft acceptance {100 * server['spec_acceptance_rate']:.0f}% "
            f"({server.get('spec_mean_acceptance_length', 1):.2f} tokens per drafting step)"
        )
    if "cost_per_million_generation_tokens" in server:
        parts.append(
            f"cost per 1M tokens: prompt {server['cost_per_million_prompt_tokens']:.4g}, "
            f"output {server['cost_per_million_generation_tokens']:.4g}"
        )
    return ", ".join(parts) or "nothing"


def write_outputs(
    out_dir: str | Path, title: str, command: str, runs: list[dict[str, Any]], x_label: str
) -> list[Path]:
    """results.json, report.md and the plots; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps({"title": title, "command": command, "runs": runs}, indent=1))
    plots = _plots(out, runs, x_label)
    report = out / "report.md"
    lines = [f"# {title}", "", f"Command: `{command}`", "", markdown_table(runs), ""]
    for run in runs:
        if run.get("server"):
            lines.append(f"- {run['label']}: server says {_server_line(run['server'])}")
        for err in run["summary"].get("first_errors", []):
            lines.append(f"- {run['label']}: error: {err}")
    lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    report.write_text("\n".join(lines) + "\n")
    return [results, report, *plots]


def _plots(out: Path, runs: list[dict[str, Any]], x_label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric, name in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end latency")):
        for run in runs:
            values = sorted(r[metric] for r in run["requests"] if r.get(metric) is not None)
            if values:
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=run["label"])
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, out / "latency_cdf.png"))

    xs = [run["x"] for run in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [run["summary"]["output_throughput"] for run in runs], marker="o", label="output tok/s")
    ax.plot(xs, [run["summary"]["goodput"] * 100 for run in runs], marker="s", label="goodput (req/s x 100)")
    ax.set_xlabel(x_label)
    ax.set_title("throughput vs load")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for q in ("p50", "p99"):
        ax.plot(xs, [run["summary"]["ttft"][q] or 0.0 for run in runs], marker="o", label=f"TTFT {q}")
    ax.set_xlabel(x_label)
    ax.set_ylabel("seconds")
    ax.set_title("TTFT vs load")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "ttft_vs_load.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
