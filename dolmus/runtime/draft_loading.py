"""What speculative decoding drafts with, loaded beside the target: a draft model
(`draft_model`), an EAGLE-3 head (`eagle3`), DeepSeek-V3's own MTP layer (`mtp`, drafting as an
EAGLE head does) or Medusa heads (`medusa`), each on the target's device, dtype and kernels.
The ngram and suffix proposers need nothing here (they live with the scheduler, spec/).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dolmus.config import EngineConfig, ModelConfig, SpeculativeConfig
from dolmus.quant.methods import make_linear_method
from dolmus.runtime.attention import AttentionBackend
from dolmus.runtime.draft_model import DraftModel
from dolmus.runtime.eagle_drafter import EagleDrafter
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.loader import load_model
from dolmus.runtime.medusa_drafter import MedusaDrafter
from dolmus.runtime.models.deepseek_mtp import load_mtp
from dolmus.runtime.models.eagle3 import load_eagle3
from dolmus.runtime.models.medusa import load_medusa

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """The loaded target model and the settings its drafters copy."""

    config: EngineConfig
    model_config: ModelConfig
    model: nn.Module
    model_path: Path
    dtype: torch.dtype
    device: torch.device
    attention: AttentionBackend
    ops: LayerOps  # the target's small-kernel table (runtime/layers/ops.py), drafters take it too

    def head_method(self) -> LinearMethod:
        """Heads keep their weights as stored (unquantized, not prepacked)."""
        return make_linear_method(False, native_kernels=self.config.native_kernels)


@dataclass
class Drafters:
    """At most one of them is set (the method decides which)."""

    draft: DraftModel | None = None
    eagle: EagleDrafter | None = None  # an EAGLE-3 head, or DeepSeek-V3's MTP layer
    medusa: MedusaDrafter | None = None


def load_drafters(spec: SpeculativeConfig | None, target: Target, max_model_len: int) -> Drafters:
    method = spec.method if spec is not None else None
    if method == "draft_model":
        return Drafters(draft=_load_draft(spec, target, max_model_len))  # type: ignore[arg-type]
    if method == "eagle3":
        return Drafters(eagle=_load_eagle(spec, target, max_model_len))  # type: ignore[arg-type]
    if method == "mtp":
        return Drafters(eagle=_load_mtp(target, max_model_len))
    if method == "medusa":
        return Drafters(medusa=_load_medusa(spec, target))  # type: ignore[arg-type]
    return Drafters()


def _load_draft(spec: SpeculativeConfig, target: Target, max_model_len: int) -> DraftModel:
    """The draft model of speculative decoding, on the target's device, dtype and kernels."""
    path = Path(spec.model)  # type: ignore[arg-type]
    cfg = ModelConfig.from_dir(path)
    if cfg.vocab_size != target.model_config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({cfg.vocab_size} tokens) is not the "
            f"target's ({target.model_config.vocab_size}); a draft must share the target's tokenizer"
        )
    config = target.config
    method = make_linear_method(
        config.prepack_weights,
        spec.quantization,
        config.quant_group_size,
        config.quant_symmetric,
        config.quant_lm_head,
        config.native_kernels,
    )
    model = load_model(
        path, cfg, target.dtype, target.device, method, target.attention, max_model_len, ops=target.ops
    )
    logger.info("draft model: %s (%d layers, quantization %s)", path, cfg.num_layers, spec.quantization)
    return DraftModel(model, cfg)


def _load_eagle(spec: SpeculativeConfig, target: Target, max_model_len: int) -> EagleDrafter:
    """An EAGLE-3 head sharing the target's embedding, and the target set to keep the hidden
    states the head reads."""
    head = load_eagle3(
        Path(spec.model),  # type: ignore[arg-type]
        target.model_config,
        target.dtype,
        target.device,
        target.head_method(),
        target.attention,
        max_model_len,
        target.ops,
    )
    if head.embed_tokens is None:
        head.embed_tokens = target.model.model.embed_tokens
    target.model.capture_layers = head.aux_layers
    logger.info("EAGLE-3 head: %s (reads layers %s)", spec.model, head.aux_layers)
    return EagleDrafter(head)


def _load_mtp(target: Target, max_model_len: int) -> EagleDrafter:
    """The target checkpoint's MTP layer, sharing the target's embedding unless it has its own."""
    head = load_mtp(
        target.model_path,
        target.model_config,
        target.dtype,
        target.device,
        target.head_method(),
        target.attention,
        max_model_len,
        target.ops,
    )
    if head.embed_tokens is None:
        head.embed_tokens = target.model.model.embed_tokens
    logger.info("MTP layer: model.layers.%d of %s", target.model_config.num_layers, target.model_path)
    return EagleDrafter(head)


def _load_medusa(spec: SpeculativeConfig, target: Target) -> MedusaDrafter:
    """Medusa heads reading the target's final hidden states."""
    heads = load_medusa(
        Path(spec.model),  # type: ignore[arg-type]
        target.model_config,
        spec.num_speculative_tokens,
        target.dtype,
        target.device,
        target.head_method(),
    )
    if not heads.lm_heads:
        heads.target_head = target.model.compute_logits
    logger.info("Medusa heads: %s (%d heads)", spec.model, heads.num_heads)
    rows = target.config.max_num_seqs
    return MedusaDrafter(heads, rows, target.model_config.hidden_size, target.dtype, target.device)
