"""The last minutes of the engine, sampled once a second, for the dashboard's charts.

/metrics is for scrapers: counters and histograms since start. A page wants a time series
without running Prometheus, so the server samples the engine's snapshot every second into a
ring buffer (ten minutes by default) and serves it as JSON; latency percentiles are taken over
the requests that finished in the last minute.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from dolmus.engine.metrics import cost_per_token
from dolmus.engine.stats import EngineStats
from dolmus.outputs import RequestOutput

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600  # ten minutes at one a second
LATENCY_WINDOW_S = 60.0  # percentiles over requests finished this recently
_MAX_LATENCIES = 20_000  # bound on the window's stored values, however busy the server


class LiveStats:
    def __init__(self, stats: Callable[[], EngineStats], cost_per_hour: float | None = None) -> None:
        self._stats = stats
        self._cost = cost_per_hour
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_SAMPLES)
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=_MAX_LATENCIES)
        self._itl: collections.deque[tuple[float, float]] = collections.deque(maxlen=_MAX_LATENCIES)
        self._lock = threading.Lock()  # finished requests arrive on the step thread in thread mode
        self._finished = 0
        self._previous: tuple[float, EngineStats] | None = None

    def observe(self, out: RequestOutput) -> None:
        """A finished request's latencies (called once per request, from any thread)."""
        now = time.time()
        with self._lock:
            self._finished += 1
            for c in out.outputs:
                m = c.metrics
                if m is None:
                    continue
                if m.ttft is not None:
                    self._ttft.append((now, m.ttft))
                self._itl.extend((now, gap) for gap in m.itl[-1000:])

    def sample(self) -> dict[str, Any]:
        """Take one sample now (the dashboard's point for this second) and keep it."""
        now = time.time()
        s = self._stats()
        prev_t, prev = self._previous if self._previous is not None else (now, s)
        dt = max(now - prev_t, 1e-9)
        queries = s.prefix_cache_queries - prev.prefix_cache_queries
        with self._lock:
            ttft = _recent(self._ttft, now)
            itl = _recent(self._itl, now)
            finished = self._finished
        point: dict[str, Any] = {
            "t": now,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "prompt_tps": (s.prompt_tokens - prev.prompt_tokens) / dt,
            "generation_tps": (s.generation_tokens - prev.generation_tokens) / dt,
            "prefix_hit_rate": (s.prefix_cache_hits - prev.prefix_cache_hits) / queries if queries else None,
            "preemptions": s.num_preemptions - prev.num_preemptions,
            "finished": finished,
            **_percentiles("ttft", ttft),
            **_percentiles("itl", itl),
        }
        self._previous = (now, s)
        self.samples.append(point)
        return point

    def totals(self) -> dict[str, Any]:
        """The counters since start, as /metrics reports them (the dashboard's headline numbers)."""
        s = self._stats()
        out: dict[str, Any] = {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "finished": {reason: s.finished.get(reason, 0) for reason in ("stop", "length", "abort")},
            "busy_seconds": s.busy_prefill_seconds + s.busy_decode_seconds,
        }
        if self._cost is not None:
            prompt, output = cost_per_token(s, self._cost)
            out["cost_per_million_prompt_tokens"] = prompt * 1e6
            out["cost_per_million_generation_tokens"] = output * 1e6
            out["cost_total"] = (s.busy_prefill_seconds + s.busy_decode_seconds) * self._cost / 3600.0
        return out

    def since(self, t: float) -> list[dict[str, Any]]:
        return [p for p in self.samples if p["t"] > t]

    async def run(self) -> None:
        """Sample forever (a task of the server's lifespan)."""
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_INTERVAL_S)


def _recent(values: collections.deque[tuple[float, float]], now: float) -> list[float]:
    while values and values[0][0] < now - LATENCY_WINDOW_S:
        values.popleft()
    return sorted(v for _, v in values)


def _percentiles(name: str, ordered: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in (50, 95, 99):
        out[f"{name}_p{q}"] = ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else None
    return out
