"""What the engine reports of itself: counters since start and the requests it holds.

Plain data (the engine core sends it to the API process every step), read by /metrics, the
dashboard, routers' load endpoints and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    prefix_cache_hit_rate: float
    prompt_tokens: int  # prompt tokens of requests that got their first token (cached included)
    generation_tokens: int
    num_preempted_waiting: int = 0  # preempted requests waiting to be recomputed
    structured_requests: int = 0  # requests with structured output since start
    weight_bytes: int = 0  # model weights as stored for compute
    kv_bytes_per_token: int = 0  # all layers
    kv_capacity_tokens: int = 0  # tokens the KV pool holds
    # Wall time spent in steps, split between prompt and output work by each step's token mix;
    # the server turns these into cost per token.
    busy_prefill_seconds: float = 0.0
    busy_decode_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    # Tier rules at work (since start): refused by SLO-aware admission, demoted by it,
    # refused after waiting longer than their tier's max_queue_wait.
    admission_refused: int = 0
    admission_demoted: int = 0
    queue_timeouts: int = 0
    # Speculative decoding since start: request-steps with drafts, drafted and accepted
    # tokens, and acceptances at each draft position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> plain decodes instead
    # KV connector since start: tokens computed again after preemptions; offload tier blocks
    # saved, tokens loaded instead of computed, entries found bad; disaggregation's tokens
    # fetched from prefill workers, failed fetches, blocks exported to decode workers.
    preemption_recomputed_tokens: int = 0
    kv_offload_saved_blocks: int = 0
    kv_offload_loaded_tokens: int = 0
    kv_offload_failed_loads: int = 0
    kv_transfer_loaded_tokens: int = 0
    kv_transfer_failed_loads: int = 0
    kv_transfer_exported_blocks: int = 0
    # Mixture-of-Experts models: tokens routed to each expert since start, per decoder layer (an
    # empty row for a dense layer), as last reported by the runner (runtime/expert_load.py:
    # exact once the engine is idle, at most a few steps behind while it is busy).
    moe_expert_tokens: list[list[int]] = field(default_factory=list)

    @property
    def moe_load_imbalance(self) -> dict[int, float]:
        """Per MoE layer that has routed tokens: its busiest expert's tokens over the mean per
        expert: 1.0 perfectly even, num_experts / top_k at worst (every token to the same k)."""
        out = {}
        for layer, row in enumerate(self.moe_expert_tokens):
            total = sum(row)
            if total:
                out[layer] = max(row) * len(row) / total
        return out


@dataclass
class RequestSummary:
    """One sequence in the engine as an operator sees it (no prompt text): for the server's
    running-requests list."""

    request_id: str
    state: str  # "running" | "waiting" | "preempted" (waiting to be recomputed)
    priority: int
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # of prompt + output, KV written (prefill progress)
    cached_tokens: int  # prompt tokens found in the prefix cache (0 until admitted)
    blocks: int  # KV blocks held
    age_s: float  # since arrival
    num_preemptions: int
