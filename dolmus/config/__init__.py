"""Configuration: the one place where defaults and choices live.

`EngineConfig` (here) holds what a user chooses (CLI flags map one-to-one onto its fields);
`ModelConfig` (model_config.py) holds what the checkpoint's config.json says. In this package
too: the KV cache's outside connections (events, transfers, offload) in kv.py, the server's own
flags in server.py, and how fields declare their choices and are read from dicts in fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dolmus.config.fields import check_choices, choice, from_known_keys
from dolmus.config.kv import KVEventsConfig, KVTransferConfig, OffloadTier, parse_kv_offload

# ServerConfig lives in config/server.py, ModelConfig in model_config.py; importers of
# dolmus.config (scripts written before the split) still find them here.
from dolmus.config.server import PRIORITY_TIERS, ServerConfig  # noqa: F401
from dolmus.model_config import DTYPE_NAMES, ModelConfig, parse_common_fields  # noqa: F401

DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "default_model"

# On a CPU the KV cache is ordinary RAM that every other process also wants, so the
# default budget is a fixed size (like vLLM's VLLM_CPU_KVCACHE_SPACE) rather than a
# fraction of the machine. On a GPU the memory is ours: take most of what is free.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85

# Token budget of one step. On this project's CPUs oneDNN's bf16 products, the quantized
# kernels and PyTorch's ops are most efficient around M=512 (measured: workload A of
# benchmarks/offline_throughput.py ran ~6% faster at 512 than at 256, 1024 or 2048), and
# smaller chunks keep decodes flowing during long prefills. Where every linear layer runs on
# our tile-packed kernel (AMX, or vdpbf16ps on AVX-512 BF16) the runner asks for
# TILE_CPU_BATCHED_TOKENS instead (kernel_choice.suited_step_tokens).
DEFAULT_CPU_BATCHED_TOKENS = 512
TILE_CPU_BATCHED_TOKENS = 2048
DEFAULT_GPU_BATCHED_TOKENS = 2048


QUANTIZATIONS = (None, "int8", "int4", "w8a8", "fp8")
KV_CACHEDTYPE_NAMES = ("auto", "int8", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")  # runtime/attention's registry, plus auto
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "llguidance")  # structured/backend.py


ADMISSION_POLICIES = ("serve", "refuse", "demote")


@dataclass(frozen=True)
class TierSpec:
    """One scheduling tier as the engine sees it (`dolmus serve --tiers FILE` sets these).

    The reserved shares (of `max_num_seqs`, of the KV blocks and of each step's token budget)
    are guarantees, not partitions: other tiers borrow whatever a tier leaves unused and
    give it back by preemption (seats, blocks) or at the next step (tokens) when it needs it.
    """

    priority: int  # the requests of this priority and laxer ones up to the next tier's
    reserved_seats: float = 0.0  # shares in [0, 1)
    reserved_kv: float = 0.0
    reserved_tokens: float = 0.0
    max_queue_wait: float | None = None  # seconds before the first step; then refused (429)
    ttft_target: float | None = None  # seconds; what admission checks the queue ahead against
    admission: str = "serve"  # a request that would miss ttft_target: serve | refuse | demote

    def __post_init__(self) -> None:
        for name in ("reserved_seats", "reserved_kv", "reserved_tokens"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} is a share in [0, 1), got {value}")
        for name in ("max_queue_wait", "ttft_target"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive seconds, got {value}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        if self.admission != "serve" and self.ttft_target is None:
            raise ValueError(f"admission {self.admission!r} needs a ttft_target")


def check_tiers(tiers: tuple[TierSpec, ...]) -> None:
    """Distinct priorities, and no resource reserved past the whole of it."""
    priorities = [t.priority for t in tiers]
    if len(set(priorities)) != len(priorities):
        raise ValueError(f"tiers: two tiers share a priority ({sorted(priorities)})")
    for name in ("reserved_seats", "reserved_kv", "reserved_tokens"):
        total = sum(getattr(t, name) for t in tiers)
        if total >= 1.0:
            raise ValueError(f"tiers: {name} add up to {total:g}; they must leave some to share (< 1)")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle3", "medusa", "mtp")
# the methods whose drafts come from a model or heads in `model`
SPECULATIVE_MODEL_METHODS = ("draft_model", "eagle3", "medusa")
# the methods whose drafts the runner makes: those, and mtp (the target checkpoint's own
# multi-token-prediction layer, DeepSeek-V3's)
SPECULATIVE_RUNNER_METHODS = (*SPECULATIVE_MODEL_METHODS, "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys (`speculative_config={"method": "ngram", ...}`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per step at most
    prompt_lookup_min: int = 2  # ngram: shortest suffix that may match earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first
    # Speculation is off in steps with more running requests than this (there the step is
    # bound by compute, and verifying drafts only adds work); None: never off.
    disable_by_batch_size: int | None = None
    # Drafts only while the step times measured on this machine say they raise a step's
    # expected tokens per second (so a busy server turns speculation off by itself); False:
    # every decode gets a window as long as its acceptance rate's share of the maximum.
    adaptive: bool = True
    # suffix: finished requests whose outputs are kept to draft from (least recently used go)
    suffix_decoding_max_cached_requests: int = 10_000
    # draft_model: the draft's folder or GGUF file (same tokenizer as the target), and how to
    # quantize its weights on load (None: as stored; e.g. "int4" makes a copy of the target a
    # cheap draft); eagle3: the head's folder (the public EAGLE-3 checkpoint layout); medusa:
    # the heads' folder (vLLM's or FasterDecoding's layout; num_speculative_tokens <= heads);
    # mtp takes none (it drafts with the target DeepSeek-V3 checkpoint's own MTP layer)
    model: str | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                f"and {self.prompt_lookup_max}"
            )
        if (self.method in SPECULATIVE_MODEL_METHODS) != (self.model is not None):
            raise ValueError(
                "speculative_config: 'model' (the draft model, or the EAGLE-3 head's or Medusa heads' "
                "folder) goes with methods draft_model, eagle3 and medusa, and only with them"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                "speculative_config: quantization must be one of "
                f"{', '.join(q for q in QUANTIZATIONS if q)}, got {self.quantization!r}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        return from_known_keys(cls, raw, "speculative_config")


@dataclass
class EngineConfig:
    """Everything a user can set on an engine. `None` means "derive it from the model"."""

    model: str | None = None  # Hugging Face folder; None serves the built-in stories260k
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = choice("auto", ("auto", *DTYPE_NAMES))
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: float | int | None = None  # bytes (int > 1) or fraction of free memory
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 128  # most requests running at once
    # step token budget; None: 512 on CPU (2048 where linears run on our tile kernel), 2048 on GPU
    max_num_batched_tokens: int | None = None
    # inter-token latency target (ms): while streams decode, a step carries only the prompt
    # tokens that its measured cost says fit within it (engine/step_timing.py); None: the budget
    itl_target_ms: float | None = None
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds unseeded sampling so a whole run is reproducible
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's choice
    # bf16 linear weights on CPU packed for the fastest kernel: tile order (our kernel, with
    # native_kernels) where the CPU has AMX or AVX-512 BF16, oneDNN's blocked layout elsewhere;
    # where bf16 is emulated (AVX2), a bf16 checkpoint's weights kept in bf16 under float32
    # (with native_kernels)
    prepack_weights: bool = True
    # on load: int8 | int4 | w8a8 (CPU) | fp8 (CUDA)
    quantization: str | None = choice(None, QUANTIZATIONS)
    quant_group_size: int = choice(32, (32, 64, 128))  # int4: inputs per scale
    quant_symmetric: bool = False  # int4: no zero points
    quant_lm_head: str = choice("int8", ("int8", "w8a8", "int4"))  # int4: the LM head's format
    # our C kernels: AMX tiles for bf16 linears, AVX-512 ones (int8/int4, norm, decode attention)
    # for bf16 CPU runs, AVX2 ones for GGUF's block types as stored
    native_kernels: bool = True
    # steps as one C call (runtime/models/llama_decode.py) where every part of the model runs
    # on those kernels: decode steps, and steps with prompt chunks where the prefill kernel
    # takes every layer; the same kernels and bits, without the per-layer glue
    fused_decode: bool = True
    # CUDA: decode-only steps replay CUDA graphs captured at start-up (runtime/cuda_graphs.py);
    # True runs every step eagerly (vLLM's --enforce-eager)
    enforce_eager: bool = False
    # Schedule step N+1 and launch it before step N's tokens reach the host, then append, stop
    # and detokenize step N while the device runs N+1 (vLLM's async scheduling, SGLang's overlap
    # scheduler): the host's work per step hides behind the device's. None: on for CUDA with the
    # model in this process. Steps fall back to one at a time while any request needs its
    # previous token on the host before sampling (seeds, penalties, min_tokens, logprobs,
    # structured output), and with speculative decoding or a KV connector.
    async_scheduling: bool | None = None
    # GGUF blocks on the AVX2 block kernels (float32 runs; bf16 ones on CPUs without AVX-512
    # BF16): float (exact products) | int8 (x rounded to int8 per block of 32, as llama.cpp
    # does, for 8-bit blocks at up to 8 rows and 4-bit ones at one: faster decode, a little
    # less accurate)
    gguf_activations: str = choice("float", ("float", "int8"))
    # auto (the model dtype) | int8 | fp8: a scale per token and head
    kv_cache_dtype: str = choice("auto", KV_CACHEDTYPE_NAMES)
    # auto: native (our C decode kernel) where the native kernels run, triton (our paged kernel)
    # on CUDA, else torch (gather + SDPA)
    attention_backend: str = choice("auto", ATTENTION_BACKENDS)
    # uni: the model runs in the engine's process; mp: in worker processes fed each step's plan
    # (vLLM's --distributed-executor-backend; tensor parallelism always runs mp)
    executor: str = choice("uni", ("uni", "mp"))
    # Tensor parallelism: ranks that each hold a share of every layer's heads and features,
    # joined by torch.distributed (gloo on CPU, NCCL on CUDA). On CPU the host's cores and KV
    # budget are split evenly between the ranks on it.
    tensor_parallel_size: int = 1
    # Mixture-of-Experts layers over those ranks: whole experts on each rank (num_experts /
    # tensor_parallel_size of them) instead of a slice of every expert (vLLM's
    # --enable-expert-parallel); attention and dense layers stay tensor-parallel.
    enable_expert_parallel: bool = False
    # Hosts the ranks span (tensor_parallel_size / nnodes on each) and this host's index: the
    # engine runs on host 0 (`dolmus serve`), the others run `dolmus worker`.
    nnodes: int = 1
    node_rank: int = 0
    # torch.distributed's env:// rendezvous on host 0; the engine's control channel listens on
    # master_port + 1. master_port None: a free port (one host only).
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # seconds a rank may take to answer a step, or wait in a collective, before the engine fails
    distributed_timeout: float = 600.0
    # grammar library for structured output: auto = xgrammar where installed, else llguidance
    structured_output_backend: str = choice("auto", STRUCTURED_OUTPUT_BACKENDS)
    # Scheduling tiers with reservations and admission rules; none: strict priority order.
    tier_specs: tuple[TierSpec, ...] = ()
    # Speculative decoding (a SpeculativeConfig or a dict of its keys); None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # KV cache events for cache-aware routers (a KVEventsConfig or a dict of vLLM's keys); None: off.
    kv_events_config: KVEventsConfig | dict[str, Any] | None = None
    # A tier below the KV pool that keeps evicted prefixes and preempted requests' work:
    # cpu (host RAM) | disk:PATH (files that outlive the process) | mooncake:HOST:PORT (a Mooncake
    # Store every engine naming that master shares); None: off. Its size in GiB (mooncake: the
    # host memory this engine's ranks contribute to the store).
    kv_offload: str | None = None
    kv_offload_size: float = 4.0
    # Disaggregated prefill/decode (a KVTransferConfig or a dict of vLLM's keys); None: off.
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.itl_target_ms is not None and not self.itl_target_ms > 0:
            raise ValueError(f"itl_target_ms must be > 0 (milliseconds), got {self.itl_target_ms}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        check_choices(self)
        self._check_parallel()
        self.tier_specs = tuple(self.tier_specs)
        check_tiers(self.tier_specs)
        if self.itl_target_ms is not None and any(t.reserved_tokens for t in self.tier_specs):
            # the holds are shares of the whole token budget; the ITL target's prompt share is
            # smaller, and the first tier to ask would take it all past the others' holds
            raise ValueError(
                "itl_target_ms does not combine with tiers' reserved_tokens yet: reserve seats or "
                "KV blocks, or drop the ITL target"
            )
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if isinstance(self.kv_events_config, dict):
            self.kv_events_config = KVEventsConfig.from_dict(self.kv_events_config)
        if isinstance(self.kv_transfer_config, dict):
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
        transfer = self.kv_transfer_config
        if self.nnodes > 1 and transfer is not None and transfer.mooncake_master is None:
            raise ValueError(
                "kv_transfer_config: over several hosts each rank's outbox is on its own host, which "
                "DolmusConnector's one address cannot name; use MooncakeStoreConnector"
            )
        parse_kv_offload(self.kv_offload)
        if self.kv_offload_size <= 0:
            raise ValueError(f"kv_offload_size must be positive GiB, got {self.kv_offload_size}")

    @property
    def kv_offload_tier(self) -> OffloadTier | None:
        return parse_kv_offload(self.kv_offload)

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """kv_transfer_config as its type (a dict was converted in __post_init__)."""
        assert self.kv_transfer_config is None or isinstance(self.kv_transfer_config, KVTransferConfig)
        return self.kv_transfer_config

    @property
    def uses_kv_connector(self) -> bool:
        return self.kv_offload is not None or self.kv_transfer_config is not None

    def _check_parallel(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if nodes < 1 or tp % nodes:
            raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size {tp}, got {nodes}")
        if self.node_rank != 0:
            raise ValueError(
                f"node_rank {self.node_rank}: the engine runs on host 0; run `dolmus worker` on the others"
            )
        if nodes > 1 and self.master_port is None:
            raise ValueError("master_port is needed when the ranks span several hosts (nnodes > 1)")
        if self.master_port is not None and not 0 < self.master_port < 65535:
            raise ValueError(f"master_port must be a TCP port below 65535, got {self.master_port}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        if tp > 1:
            self.executor = "mp"  # ranks are processes

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL_DIR

    def async_steps(self, device: torch.device) -> bool:
        """Whether runners keep the last step's tokens on the device for async scheduling (the
        engine adds its own conditions: the model in this process, no drafts, no connector)."""
        return self.async_scheduling if self.async_scheduling is not None else device.type == "cuda"

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for but CUDA is not available")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        return device

    def resolve_batched_tokens(self, device: torch.device, suited: int | None = None) -> int:
        """The step token budget: the one asked for, else what the loaded model's kernels suit
        (`suited`, from the runner), else the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if suited is not None:
            return suited
        return DEFAULT_GPU_BATCHED_TOKENS if device.type == "cuda" else DEFAULT_CPU_BATCHED_TOKENS

    def resolve_dtype(
        self, model_dtype: torch.dtype, device: torch.device, cpu_has_bf16: bool = True
    ) -> torch.dtype:
        """`auto` keeps the checkpoint's dtype where the device runs it well.

        CPUs have no fast fp16, so fp16 checkpoints (and GGUF files of fp16 or quantized types)
        run as bf16 on CPUs with bf16 instructions (AVX-512 BF16, AMX) and as float32 on the
        others (`cpu_has_bf16` false), where bf16 is emulated and our kernels are float32 ones;
        fp32 on a GPU stays fp32 only when asked for.
        """
        if self.dtype != "auto":
            dtype = DTYPE_NAMES[self.dtype]
            if device.type == "cpu" and dtype == torch.float16:
                raise ValueError("dtype float16 is not supported on CPU: use bfloat16 or float32")
            return dtype
        if device.type == "cpu":
            return torch.bfloat16 if model_dtype != torch.float32 and cpu_has_bf16 else torch.float32
        if model_dtype == torch.float32:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return model_dtype
