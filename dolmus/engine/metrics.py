"""Prometheus metrics, named `dolmus:<name>` with units in the name (vLLM's `vllm:` scheme).

Latency histograms are observed once per finished request from its timings. Gauges and
counters are read at scrape time from the engine's latest stats snapshot, so the step loop
pays nothing for them. Each server owns its own registry: no module-global state.

Schedulers in front of replicas read vLLM's names and nothing else by default: llm-d's
inference scheduler (the Gateway API Inference Extension's endpoint picker) scores by
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (older
releases `vllm:gpu_cache_usage_perc`), `vllm:lora_requests_info` and the block size in
`vllm:cache_config_info`. VLLM_ALIASES decides which of ours are also rendered under vLLM's
name: the same samples, so the two can never disagree, and our names stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dolmus.engine.stats import EngineStats
from dolmus.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
# fmt: on

# Ours -> vLLM's names for the same figure (same type, labels and meaning as vLLM's).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "dolmus:num_requests_running": ("vllm:num_requests_running",),
    "dolmus:num_requests_waiting": ("vllm:num_requests_waiting",),
    "dolmus:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "dolmus:cache_config_info": ("vllm:cache_config_info",),
    "dolmus:lora_requests_info": ("vllm:lora_requests_info",),
    "dolmus:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "dolmus:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "dolmus:num_preemptions": ("vllm:num_preemptions",),
    "dolmus:prompt_tokens": ("vllm:prompt_tokens",),
    "dolmus:generation_tokens": ("vllm:generation_tokens",),
    "dolmus:request_success": ("vllm:request_success",),
}


class EngineMetrics:
    """The metrics of one served model.

    `cost_per_hour` (currency per hour of the machine) turns the engine's busy time into
    cost per million prompt and output tokens; busy time is split between prompt and output
    work by each step's token mix (see Engine.step).
    """

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        cost_per_hour: float | None = None,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        """`cache_config`: the KV cache's settings as labels of `cache_config_info` (vLLM's
        `block_size`, `cache_dtype`, `enable_prefix_caching`); the block count comes from stats."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("dolmus:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("dolmus:inter_token_latency_seconds", "Time between output tokens.", _TOKEN_BUCKETS)
        self.tpot = hist(
            "dolmus:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _TOKEN_BUCKETS,
        )
        self.e2e = hist("dolmus:e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.grammar_compile = hist(
            "dolmus:grammar_compile_seconds",
            "Compile time of each distinct structured-output spec.",
            (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )
        self.queue = hist(
            "dolmus:request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.registry.register(_StatsCollector(model_name, stats, cost_per_hour, cache_config or {}))
        # Per tier (the server's tiers file names them; a fixed set, so bounded labels).
        by_tier = ["model_name", "tier"]
        self._tier_ttft = Histogram(
            "dolmus:tier_time_to_first_token_seconds", "Time to first token, by tier.", by_tier,
            buckets=_TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tier_tpot = Histogram(
            "dolmus:tier_request_time_per_output_token_seconds", "Mean time per output token, by tier.",
            by_tier, buckets=_TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tier_queue = Histogram(
            "dolmus:tier_request_queue_time_seconds", "Arrival to first scheduled, by tier.", by_tier,
            buckets=_REQUEST_BUCKETS, registry=self.registry,
        )  # fmt: skip
        by_app = ["model_name", "app"]  # the tiers file's key names: a bounded label set
        self._app_requests = Counter(
            "dolmus:app_requests",
            "Finished requests, by the app of their API key.",
            by_app,
            registry=self.registry,
        )
        self._app_prompt = Counter(
            "dolmus:app_prompt_tokens",
            "Prompt tokens of finished requests, by app.",
            by_app,
            registry=self.registry,
        )
        self._app_generation = Counter(
            "dolmus:app_generation_tokens", "Generated tokens, by app.", by_app, registry=self.registry
        )
        self._tier_finished = Counter(
            "dolmus:tier_requests", "Finished requests, by tier.", by_tier, registry=self.registry
        )
        self._tier_met = Counter(
            "dolmus:tier_slo_met",
            "Finished requests that met every TTFT/TPOT target of their tier (goodput: its rate).",
            by_tier,
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Record the latencies of every completion of a finished request."""
        for completion in output.outputs:
            m = completion.metrics
            if m is None:
                continue
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if m.queue_time is not None:
                self.queue.observe(m.queue_time)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            for gap in m.itl:
                self.itl.observe(gap)

    def observe_tier(self, tier: str, output: RequestOutput, slo_met: bool) -> None:
        """Record a finished request under its tier, and whether it met the tier's targets."""
        labels = (self.model_name, tier)
        for completion in output.outputs:
            m = completion.metrics
            if m is None:
                continue
            if m.ttft is not None:
                self._tier_ttft.labels(*labels).observe(m.ttft)
            if m.tpot is not None:
                self._tier_tpot.labels(*labels).observe(m.tpot)
            if m.queue_time is not None:
                self._tier_queue.labels(*labels).observe(m.queue_time)
        self._tier_finished.labels(*labels).inc()
        if slo_met:
            self._tier_met.labels(*labels).inc()

    def observe_app(self, app: str, output: RequestOutput) -> None:
        """Count a finished request and its tokens under the app of the key that sent it."""
        labels = (self.model_name, app)
        self._app_requests.labels(*labels).inc()
        self._app_prompt.labels(*labels).inc(len(output.prompt_token_ids or []))
        self._app_generation.labels(*labels).inc(sum(len(c.token_ids) for c in output.outputs))

    def add_replicas(self, stats: Callable[[], list[EngineStats]]) -> None:
        """Per-replica gauges beside the merged ones (data parallelism), labelled `replica`."""
        self.registry.register(_ReplicaCollector(self.model_name, stats))

    def render(self) -> bytes:
        return generate_latest(_WithAliases(self.registry))


class _WithAliases(Collector):
    """Every family of `source` that has samples, each followed by its copies under
    VLLM_ALIASES' names. A labelled family nothing was observed in yet (no tier, no app so
    far) is left out, as vLLM leaves it: sglang-router's /engine_metrics merges the replicas'
    families and refuses one whose label names differ between replicas."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if not family.samples:
                continue
            yield family
            for alias in VLLM_ALIASES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                tail = len(family.name)
                copy.samples = [s._replace(name=alias + s.name[tail:]) for s in family.samples]
                yield copy


class _StatsCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        cost_per_hour: float | None,
        cache_config: dict[str, str],
    ) -> None:
        self._model = model_name
        self._stats = stats
        self._cost = cost_per_hour
        self._cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        m = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("dolmus:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("dolmus:num_requests_waiting", "Sequences waiting for a seat.", s.num_waiting)
        yield gauge(
            "dolmus:num_requests_preempted",
            "Preempted sequences waiting to be recomputed.",
            s.num_preempted_waiting,
        )
        yield gauge("dolmus:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage)
        yield gauge("dolmus:kv_cache_blocks_total", "KV-cache blocks in the pool.", s.kv_blocks_total)
        info = dict(self._cache_config, num_gpu_blocks=str(s.kv_blocks_total))
        cache = GaugeMetricFamily(
            "dolmus:cache_config_info", "The KV cache's settings, as labels (value 1).", labels=[*info]
        )
        cache.add_metric(list(info.values()), 1.0)
        yield cache
        # No LoRA adapters: none running or waiting, room for none. Pickers that weigh adapter
        # affinity read this; vLLM's value is the time of the reading.
        lora = GaugeMetricFamily(
            "dolmus:lora_requests_info",
            "LoRA adapters running and waiting (dolmus serves none), as labels.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        yield gauge("dolmus:kv_cache_blocks_used", "KV-cache blocks held by requests.", s.kv_blocks_used)
        yield gauge(
            "dolmus:kv_cache_bytes_per_token", "KV-cache bytes per token, all layers.", s.kv_bytes_per_token
        )
        yield gauge("dolmus:kv_cache_capacity_tokens", "Tokens the KV cache holds.", s.kv_capacity_tokens)
        yield gauge("dolmus:model_weight_bytes", "Model weights as stored for compute.", s.weight_bytes)
        yield counter("dolmus:num_preemptions", "Preemptions since start.", s.num_preemptions)
        yield counter(
            "dolmus:prompt_tokens", "Prompt tokens of requests that started generating.", s.prompt_tokens
        )
        yield counter("dolmus:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("dolmus:structured_requests", "Requests with structured output.", s.structured_requests)
        yield counter(
            "dolmus:admission_refused",
            "Requests refused (429) because their tier's TTFT target could not be met.",
            s.admission_refused,
        )
        yield counter(
            "dolmus:admission_demoted",
            "Requests moved to a laxer tier because their tier's TTFT target could not be met.",
            s.admission_demoted,
        )
        yield counter(
            "dolmus:spec_decode_num_drafts", "Request-steps that carried drafts.", s.spec_num_drafts
        )
        yield counter(
            "dolmus:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens
        )
        yield counter(
            "dolmus:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens
        )
        per_position = CounterMetricFamily(
            "dolmus:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first).",
            labels=["model_name", "position"],
        )
        for i, accepted in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([self._model, str(i)], accepted)
        yield per_position
        fallbacks = CounterMetricFamily(
            "dolmus:spec_decode_num_fallbacks",
            "Decodes that ran without drafts they could have had: cost (the measured step times said "
            "a window would not pay) or memory (no KV blocks free for it).",
            labels=["model_name", "reason"],
        )
        for reason, count in sorted(s.spec_fallbacks.items()):
            fallbacks.add_metric([self._model, reason], count)
        yield fallbacks
        yield from _expert_load(s, self._model)
        yield counter(
            "dolmus:queue_timeouts",
            "Requests refused (429) after waiting past their tier's max_queue_wait.",
            s.queue_timeouts,
        )
        yield counter(
            "dolmus:preemption_recomputed_tokens",
            "Tokens computed again after preemptions (an offload tier keeps the work instead).",
            s.preemption_recomputed_tokens,
        )
        yield counter(
            "dolmus:kv_offload_saved_blocks", "Blocks saved to the offload tier.", s.kv_offload_saved_blocks
        )
        yield counter(
            "dolmus:kv_offload_loaded_tokens",
            "Tokens loaded from the offload tier instead of computed.",
            s.kv_offload_loaded_tokens,
        )
        yield counter(
            "dolmus:kv_offload_failed_loads",
            "Offload-tier loads that found an entry missing or corrupt (recomputed).",
            s.kv_offload_failed_loads,
        )
        yield counter(
            "dolmus:kv_transfer_loaded_tokens",
            "Prompt tokens fetched from prefill workers (disaggregated prefill/decode).",
            s.kv_transfer_loaded_tokens,
        )
        yield counter(
            "dolmus:kv_transfer_failed_loads",
            "Fetches from prefill workers that failed (the peer gone, or the prompt no longer held).",
            s.kv_transfer_failed_loads,
        )
        yield counter(
            "dolmus:kv_transfer_exported_blocks",
            "Prompt blocks kept for decode workers (disaggregated prefill/decode).",
            s.kv_transfer_exported_blocks,
        )
        yield counter(
            "dolmus:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "dolmus:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        finished = CounterMetricFamily(
            "dolmus:request_success",
            "Finished sequences by reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in ("stop", "length", "abort"):
            finished.add_metric([self._model, reason], s.finished.get(reason, 0))
        yield finished
        busy = s.busy_prefill_seconds + s.busy_decode_seconds
        yield counter("dolmus:engine_busy_seconds", "Wall time spent in engine steps.", busy)
        if self._cost is not None:
            prompt, output = cost_per_token(s, self._cost)
            yield gauge(
                "dolmus:cost_per_million_prompt_tokens",
                "Busy cost per 1M prompt tokens at --gpu-hour-cost.",
                prompt * 1e6,
            )
            yield gauge(
                "dolmus:cost_per_million_generation_tokens",
                "Busy cost per 1M generated tokens at --gpu-hour-cost.",
                output * 1e6,
            )


def _expert_load(s: EngineStats, model: str) -> Iterator[Metric]:
    """A Mixture-of-Experts model's routed tokens by layer and expert (layers x experts series:
    a bounded set), and each layer's imbalance; nothing for a dense model."""
    if not s.moe_expert_tokens:
        return
    routed = CounterMetricFamily(
        "dolmus:moe_expert_tokens",
        "Tokens routed to each expert of each Mixture-of-Experts layer (a token counts once per "
        "expert it chose: top_k times per layer).",
        labels=["model_name", "layer", "expert"],
    )
    for layer, row in enumerate(s.moe_expert_tokens):
        for expert, tokens in enumerate(row):
            routed.add_metric([model, str(layer), str(expert)], tokens)
    yield routed
    imbalance = GaugeMetricFamily(
        "dolmus:moe_load_imbalance",
        "Per Mixture-of-Experts layer: its busiest expert's tokens over the mean per expert (1: even).",
        labels=["model_name", "layer"],
    )
    for layer, ratio in s.moe_load_imbalance.items():
        imbalance.add_metric([model, str(layer)], ratio)
    yield imbalance


class _ReplicaCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], list[EngineStats]]) -> None:
        self._model = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        parts = self._stats()
        families = (  # (kind, name, doc, EngineStats field)
            (GaugeMetricFamily, "num_requests_running", "Running sequences", "num_running"),
            (GaugeMetricFamily, "num_requests_waiting", "Waiting sequences", "num_waiting"),
            (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache use (0-1)", "kv_usage"),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up", "prefix_cache_queries"),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found", "prefix_cache_hits"),
            (CounterMetricFamily, "generation_tokens", "Generated tokens", "generation_tokens"),
        )
        for kind, name, doc, field in families:
            family = kind(f"dolmus:replica_{name}", f"{doc}, by replica.", labels=["model_name", "replica"])
            for i, s in enumerate(parts):
                family.add_metric([self._model, str(i)], getattr(s, field))
            yield family


def cost_per_token(s: EngineStats, cost_per_hour: float) -> tuple[float, float]:
    """The busy cost of one prompt token and of one generated token so far (0 before any)."""
    per_second = cost_per_hour / 3600.0
    prompt = s.busy_prefill_seconds * per_second / s.prompt_tokens if s.prompt_tokens else 0.0
    output = s.busy_decode_seconds * per_second / s.generation_tokens if s.generation_tokens else 0.0
    return prompt, output
