"""What a checkpoint's config.json says, normalised into `ModelConfig`.

Read across the transformers 4.x (`rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`,
`dtype`) spellings so the rest of the engine reads one shape. The fields every architecture
shares are read here (`parse_common_fields`); each architecture's file under runtime/models
adds its own facts and registers itself (runtime/models/registry.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None  # keys a query attends to, itself included: (p - window, p]
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    quantization_config: dict[str, Any] | None = None  # a pre-quantized checkpoint's format
    # Mixture-of-Experts (0: a dense MLP): experts per layer, experts each token goes through,
    # an expert's inner size, a shared expert's (0: none), whether the chosen experts' weights
    # are renormalized to sum to 1, and the layers that keep a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: list[int] = field(default_factory=list)
    # The layers that attend within `sliding_window` (the others attend to everything); None:
    # every layer, when sliding_window is set (Mistral). Gemma 3 and Qwen2 mix the two kinds.
    sliding_layers: list[int] | None = None
    # Gemma 3: the softmax scale (None: head_dim ** -0.5), the rotary base of the windowed
    # layers (None: rope_theta, as every other layer), and tanh capping of the final logits
    attention_scale: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: not MLA): the ranks of the
    # compressed query (0: a plain q_proj) and key/value latent, each head's non-rotary and
    # rotary query/key parts and its value size, and whether rotary pairs are interleaved
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek routing (runtime/models/deepseek_moe.py): shared experts' inner size, the
    # scoring ("softmax": V2, "sigmoid": V3 with a score-correction bias), the top-k method
    # (V2: "greedy" or "group_limited_greedy"), expert groups and groups kept, and the factor
    # the chosen experts' weights are multiplied by
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def window_of(self, layer: int) -> int | None:
        """The attention window of one layer; None: it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, so KV older than it is never read again; None
        when any layer attends to the whole context (then no block can be freed early)."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def kv_layout(self, num_kv_heads: int | None = None) -> tuple[int, int, int | None]:
        """(heads, numbers per head, value numbers) one layer caches per token: `num_kv_heads`
        (this rank's; default all) of head_dim, values alike (None); or, under multi-head
        latent attention, one vector (the latent, then the rotated shared key) whose latent
        part is the values (runtime/attention/kv_store.py's LatentPagedKV)."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        return (self.num_kv_heads if num_kv_heads is None else num_kv_heads), self.head_dim, None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"model: path {str(path)!r} does not exist")
        from dolmus.runtime.gguf_loader import gguf_config, is_gguf

        if is_gguf(path):
            return cls.from_dict(gguf_config(path), {}, source=str(path))
        if not path.is_dir():
            raise ValueError(f"model: {str(path)!r} is not a Hugging Face model folder")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"model: {config_file} is not valid JSON ({exc})") from exc
        generation = {}
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            generation = json.loads(gen_file.read_text())
        return cls.from_dict(raw, generation, source=str(config_file))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        """Normalise a config.json dict; its architecture's own parser (the registry) reads it."""
        # The registry imports the model files; importing it here, at call time, keeps
        # dolmus.config free of them (they import ModelConfig from here).
        from dolmus.runtime.models.registry import architecture

        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"model: {source} names no architecture ('architectures' is empty)")
        arch = architecture(archs[0])
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return cls(
            architecture=arch.name,
            **arch.parse(raw, source),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        )


def parse_common_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The `ModelConfig` fields every architecture reads the same way (all but the
    architecture name and the generation config's token ids); an architecture's parser
    starts from these and overrides its own facts."""

    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"model: {source} lacks the field {key!r}")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(
            f"model: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    rope_theta, rope_scaling = _read_rope(raw)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"model: hidden_act {act!r} is not supported (only silu)")
    num_layers = int(need("num_hidden_layers"))
    window, sliding_layers = read_sliding_window(raw, num_layers, source)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return dict(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=False,
        hidden_act=act,
        sliding_window=window,
        sliding_layers=sliding_layers,
        dtype=DTYPE_NAMES.get(str(dtype_name), torch.float32),
        quantization_config=raw.get("quantization_config"),
    )


def read_sliding_window(
    raw: dict[str, Any], num_layers: int, source: str, default_layers: list[int] | None = None
) -> tuple[int | None, list[int] | None]:
    """(window, the layers that use it) as transformers reads them: `layer_types` where the
    config lists them, else the family's `default_layers` (None: every layer, as Mistral). No
    window where `use_sliding_window` is false (Qwen's configs carry one they do not use) or no
    layer uses it; layers None: all of them."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window", True) is False:
        return None, None
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"model: {source} lists {len(types)} layer_types for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"model: {source} has layer_types {sorted(unknown)} (not supported)")
        layers: list[int] | None = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        layers = default_layers
    if layers is not None and not layers:
        return None, None
    if layers == list(range(num_layers)):
        layers = None
    return int(window), layers


def _read_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (theta, scaling) from either `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"model: rope type {rope_type!r} is not supported (default, linear, llama3)")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling


# Scheduler priorities of the X-Priority header's tiers (lower runs first). A request
# without the header or a `priority` field is interactive.
