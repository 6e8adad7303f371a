"""The engine's command-line flags, shared by every command that builds an engine (`worker`
takes the parallel ones): each flag maps onto one EngineConfig field with that field's
choices (dolmus/config/), and parsed flags go back into the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import TypeVar

from dolmus.config import (
    SPECULATIVE_METHODS,
    SPECULATIVE_MODEL_METHODS,
    EngineConfig,
    SpeculativeConfig,
    TierSpec,
)
from dolmus.config.kv import KVEventsConfig, KVTransferConfig

T = TypeVar("T")


def _kv_memory(text: str) -> float | int:
    value = float(text)
    return value if value <= 1 else int(value)


def field_choices(cls: type, name: str) -> list:
    """A field's declared choices (dolmus/config/), in the CLI's spelling (`None` is left out: no flag)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[name]
    return [c for c in meta["choices"] if c is not None]


def _tier_specs(text: str) -> tuple[TierSpec, ...]:
    """`--tier-specs '[{"priority": 0, "reserved_seats": 0.25}, {"priority": 1}]'`."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
            raise ValueError("a JSON list of objects")
        return tuple(TierSpec(**t) for t in raw)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"tier specs: {exc}") from None


def _json_object(text: str, what: str, build: Callable[[dict], T]) -> T:
    """A flag's JSON object, built into its config class; argparse's error naming `what`."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a JSON object")
        return build(raw)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{what}: {exc}") from None


def _speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` (vLLM's keys)."""
    return _json_object(text, "speculative config", SpeculativeConfig.from_dict)


def _kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'` (vLLM's keys)."""
    return _json_object(text, "kv events config", KVEventsConfig.from_dict)


def _kv_transfer_config(text: str) -> KVTransferConfig:
    """`--kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14579}'` (vLLM's keys)."""
    return _json_object(text, "kv transfer config", KVTransferConfig.from_dict)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model folder (default: built-in stories260k)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=field_choices(EngineConfig, "dtype"))
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda[:N]")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument(
        "--kv-cache-memory",
        type=_kv_memory,
        default=None,
        help="KV cache budget: bytes, or a fraction (<=1) of free memory (default: 4 GiB on CPU)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="step token budget (default: 512 on CPU, 2048 on GPU and where all linears run our tile kernel)",
    )
    g.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="inter-token latency target: while streams decode, a step takes only the prompt tokens "
        "its measured cost fits within it (default: none, the token budget alone)",
    )
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    g.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=d.prepack_weights)
    g.add_argument(
        "--quantization",
        choices=field_choices(EngineConfig, "quantization"),
        default=d.quantization,
        help="on load: int8/int4 weight-only, w8a8 (int8 activations too), fp8 (CUDA only)",
    )
    g.add_argument(
        "--quant-group-size",
        type=int,
        default=d.quant_group_size,
        choices=field_choices(EngineConfig, "quant_group_size"),
        help="int4: inputs per scale",
    )
    g.add_argument("--quant-symmetric", action="store_true", help="int4 without zero points")
    g.add_argument(
        "--kv-cache-dtype",
        choices=field_choices(EngineConfig, "kv_cache_dtype"),
        default=d.kv_cache_dtype,
        help="KV cache storage: the model dtype, or int8/fp8 with a scale per token and head",
    )
    g.add_argument(
        "--quant-lm-head",
        choices=field_choices(EngineConfig, "quant_lm_head"),
        default=d.quant_lm_head,
        help="int4: head format",
    )
    g.add_argument(
        "--gguf-activations",
        choices=field_choices(EngineConfig, "gguf_activations"),
        default=d.gguf_activations,
        help="GGUF blocks on the AVX2 kernels (float32 runs): int8 rounds x to int8 per block of 32 "
        "at decode (8-bit blocks up to 8 sequences, 4-bit ones at one), as llama.cpp does: faster, "
        "a little less accurate",
    )
    g.add_argument(
        "--attention-backend",
        choices=field_choices(EngineConfig, "attention_backend"),
        default=d.attention_backend,
        help="torch (gather + SDPA), native (our C decode kernel; bf16 on AVX-512 BF16 CPUs) or "
        "triton (our paged kernel; CUDA); auto: native or triton where they run, else torch",
    )
    g.add_argument(
        "--structured-output-backend",
        choices=field_choices(EngineConfig, "structured_output_backend"),
        default=d.structured_output_backend,
        help="grammar library: xgrammar (fastest masks; the xgrammar extra) or llguidance (a plain "
        "install's); auto picks xgrammar where installed",
    )
    g.add_argument(
        "--executor",
        "--distributed-executor-backend",
        dest="executor",
        choices=field_choices(EngineConfig, "executor"),
        default=d.executor,
        help="uni: the model in the engine's process; mp: in worker processes (tensor parallelism: always)",
    )
    add_parallel_args(g, d)
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=d.enable_expert_parallel,
        help="Mixture-of-Experts layers: whole experts on each tensor-parallel rank (num_experts / "
        "--tensor-parallel-size each) instead of a slice of every expert",
    )
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=d.distributed_timeout,
        help="seconds a rank may take to answer a step before the engine fails",
    )
    g.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=d.native_kernels,
        help="our C kernels on CPU (else PyTorch's and oneDNN's): AMX tiles for bf16 linears, AVX-512 ones "
        "for bf16 (int8/int4, RMSNorm, decode attention), AVX2 ones for GGUF's block types as stored",
    )
    g.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=d.fused_decode,
        help="steps as one call into our C kernels where the whole model runs on them: decode steps, "
        "and steps with prompt chunks where no layer has a sliding window (the same tokens; no "
        "per-layer Python and PyTorch glue)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="CUDA: run every step eagerly instead of replaying CUDA graphs for decode steps",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d.async_scheduling,
        help="launch each step before the last one's tokens reach the host, so appending, stop "
        "checks and detokenizing overlap the device's work (default: on for CUDA)",
    )
    g.add_argument(
        "--tier-specs",
        type=_tier_specs,
        default=d.tier_specs,
        help="JSON list of scheduling tiers (priority, reserved_seats/kv/tokens, max_queue_wait, "
        "ttft_target, admission); `serve --tiers FILE` sets them from the tiers file",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=d.speculative_config,
        help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": null}; methods '
        f'{", ".join(SPECULATIVE_METHODS)}; {", ".join(SPECULATIVE_MODEL_METHODS)} take "model": the '
        "draft model's, EAGLE-3 head's or Medusa heads' folder",
    )
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=d.kv_events_config,
        help="KV cache events for cache-aware routers as JSON, vLLM's keys: "
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558", "topic": "kv-events"} (also publisher, buffer_steps, hwm, max_queue_size; '
        "ours: bind)",
    )
    g.add_argument(
        "--kv-offload",
        default=d.kv_offload,
        help="a KV tier below the cache that keeps evicted prefixes and preempted requests' work: "
        "cpu (host RAM), disk:PATH (survives restarts) or mooncake:HOST:PORT (a Mooncake Store shared "
        "by every engine that names this master; name it by an address the other hosts reach)",
    )
    g.add_argument(
        "--kv-offload-size",
        type=float,
        default=d.kv_offload_size,
        help="the tier's size in GiB (mooncake: the host memory this engine adds to the store)",
    )
    g.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        default=d.kv_transfer_config,
        help="disaggregated prefill/decode as JSON, vLLM's keys: "
        '{"kv_role": "kv_producer"|"kv_consumer"|"kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579, '
        '"kv_buffer_size": 1e9, "kv_load_failure_policy": "fail"|"recompute", "kv_transfer_timeout": 30}',
    )


def add_parallel_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Tensor parallelism and where its ranks meet (shared by `serve` and `worker`)."""
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks each holding a share of every layer (torch.distributed)",
    )
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the ranks span")
    g.add_argument("--node-rank", type=int, default=d.node_rank, help="this host's index (0 runs the engine)")
    g.add_argument("--master-addr", default=d.master_addr, help="host 0's address, reachable from every host")
    g.add_argument(
        "--master-port",
        type=int,
        default=d.master_port,
        help="torch.distributed's rendezvous port on host 0 (the engine's control channel: port + 1)",
    )


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass `cls` with every field that has a flag of the same name."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)
