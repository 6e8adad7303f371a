"""What a server says about a run, read from its Prometheus /metrics before and after.

dolmus (`dolmus:`) and vLLM (`vllm:`) use the same names for the figures read here; a server
without /metrics (llama.cpp without --metrics) simply yields nothing. dolmus also renders some
figures under vLLM's names for schedulers (engine/metrics.py), so one prefix is read per server,
never both: the first of _PREFIXES that has samples.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIXES = ("dolmus:", "vllm:")


async def scrape(http: httpx.AsyncClient, root_url: str) -> dict[str, float] | None:
    """Every sample summed over its labels, keyed by name without the engine prefix."""
    try:
        response = await http.get(root_url.rstrip("/") + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    by_prefix: dict[str, dict[str, float]] = {prefix: {} for prefix in _PREFIXES}
    try:
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                for prefix, samples in by_prefix.items():
                    if s.name.startswith(prefix):
                        key = s.name[len(prefix) :]
                        if "finished_reason" in s.labels:
                            key += "{" + s.labels["finished_reason"] + "}"
                        samples[key] = samples.get(key, 0.0) + s.value
    except ValueError:
        return None
    return next((samples for samples in by_prefix.values() if samples), None)


async def scrape_all(http: httpx.AsyncClient, root_urls: list[str]) -> dict[str, float] | None:
    """Several servers read as one fleet (the replicas behind a router: a router's own /metrics
    is not theirs, and vllm-router hands /metrics to one replica at a time). Counters and
    histogram sums add up; the cost gauges are each server's own and are left out."""
    parts = [await scrape(http, url) for url in root_urls]
    if len(parts) == 1 or any(p is None for p in parts):
        return parts[0] if len(parts) == 1 else None
    merged: dict[str, float] = {}
    for part in parts:
        assert part is not None
        for key, value in part.items():
            if not key.startswith("cost_per_million"):
                merged[key] = merged.get(key, 0.0) + value
    return merged


def run_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The server's own account of the run: counter deltas and histogram means."""
    if not before or not after:
        return None

    def delta(name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    def mean(hist: str) -> float | None:
        total, count = delta(f"{hist}_sum"), delta(f"{hist}_count")
        return total / count if total is not None and count else None

    hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
    # Speculative decoding (same names in vLLM): acceptance, and tokens per drafting step.
    drafts, drafted = delta("spec_decode_num_drafts_total"), delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    out: dict[str, Any] = {
        "prompt_tokens": delta("prompt_tokens_total"),
        "generation_tokens": delta("generation_tokens_total"),
        "finished_requests": sum(
            after[k] - before.get(k, 0.0) for k in after if k.startswith("request_success_total")
        ),
        "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
        "mean_ttft": mean("time_to_first_token_seconds"),
        "mean_itl": mean("inter_token_latency_seconds"),
        "mean_tpot": mean("request_time_per_output_token_seconds"),
        "mean_e2e": mean("e2e_request_latency_seconds"),
        "mean_queue_time": mean("request_queue_time_seconds"),
        "spec_acceptance_rate": accepted / drafted if accepted is not None and drafted else None,
        "spec_mean_acceptance_length": 1 + accepted / drafts if accepted is not None and drafts else None,
        "cost_per_million_prompt_tokens": after.get("cost_per_million_prompt_tokens"),
        "cost_per_million_generation_tokens": after.get("cost_per_million_generation_tokens"),
    }
    return {k: v for k, v in out.items() if v is not None}
