"""From per-request measurements to the figures a run reports.

Goodput is the rate (and share) of requests that succeeded and met every bound of the SLO;
per-tier summaries are computed the same way on each tier's requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dolmus.bench.loadgen import RequestResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_QUANTILES = (50, 90, 95, 99)


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=0.5,tpot=0.05` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in SLO_METRICS:
            raise ValueError(f"SLO metric {name!r} is not one of {', '.join(SLO_METRICS)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO bound for {name} must be a number of seconds, got {value!r}") from None
        if slo[name] <= 0:
            raise ValueError(f"SLO bound for {name} must be positive")
    return slo


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in _QUANTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in _QUANTILES}}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    for name, bound in slo.items():
        if name == "itl":
            value = max(r.itl) if r.itl else 0.0
        else:
            value = getattr(r, name)
        if value is not None and value > bound:
            return False
        if value is None and name == "ttft":
            return False
    return True


def summarize(
    results: list[RequestResult], duration: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    slo = slo or {}
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo)]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "e2e": distribution([r.e2e for r in ok if r.e2e is not None]),
        "slo": slo,
        "goodput": len(good) / duration,
        "goodput_share": len(good) / len(results) if results else 0.0,
    }
    queue = [r.queue_time for r in ok if r.queue_time is not None]
    if queue:
        summary["queue_time"] = distribution(queue)
    errors = [r.error for r in results if r.error]
    if errors:
        summary["first_errors"] = sorted(set(errors))[:5]
    return summary


def summarize_tiers(
    results: list[RequestResult], duration: float, slo: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """One summary per tier, when the requests carry tiers."""
    tiers = sorted({r.tier for r in results if r.tier})
    return {t: summarize([r for r in results if r.tier == t], duration, slo) for t in tiers}
