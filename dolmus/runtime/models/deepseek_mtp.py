"""DeepSeek-V3's multi-token prediction (MTP) layer as a speculative proposer (`method: "mtp"`).

V3 checkpoints keep, past the last decoder layer (model.layers.{num_hidden_layers}), a module
trained to predict one token further: at position p it reads the embedding of the token at
p + 1 and the target's hidden state at p,

    h = eh_proj([enorm(embed(t[p+1])), hnorm(hidden[p])])
    h = decoder_layer(h)                      (MLA + DeepSeek MoE, like the target's layers)
    logits(t[p+2]) = shared_head.head(shared_head.norm(h))

transformers drops these weights; this module loads them from the target's own safetensors.
It plugs into the runner exactly as an EAGLE-3 head does (eagle_drafter.py: catch-up over the
positions the target kept, then one position per further draft with its own output as the next
feature, its latent KV in a pool of the target's blocks). As in vLLM, the hidden state it reads
is the target's final one (after the model's norm), and further drafts reuse the one MTP layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from dolmus.config import ModelConfig
from dolmus.runtime.attention import AttentionBackend, AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.linear import Linear, load_plain
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.loader import iter_weights, safetensors_files
from dolmus.runtime.models.deepseek import deepseek_layer, route_deepseek_weight
from dolmus.runtime.models.llama import expected_weights, process_loaded_weights
from dolmus.runtime.models.mla import DeepseekRotary

# the MTP module's own tensors; the rest of its names are a decoder layer's
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, method: LinearMethod, ops: LayerOps) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, method.head_method())


class MTPHead(nn.Module):
    # the runner hands it the target's final hidden states, not layers it captured
    reads_final_hidden = True

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = None  # the target's, unless the checkpoint has one
        self.rotary = DeepseekRotary(cfg, max_len, dtype)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.eh_proj = Linear(2 * h, h, False, dtype, method)
        self.layer = deepseek_layer(cfg, cfg.num_layers, dtype, method, backend, ops)
        self.shared_head = SharedHead(cfg, dtype, method, ops)

    def kv_layout(self) -> tuple[int, int, int | None]:
        """One latent vector per token, as the target's layers (ModelConfig.kv_layout)."""
        return self.cfg.kv_layout()

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature of positions the target computed: its final hidden state as it is."""
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the head, output before the norm: the next position's feature
        when the target has not computed it)."""
        assert self.embed_tokens is not None
        embeds = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat((embeds, self.hnorm(features)), dim=-1))
        out, residual = self.layer(x, None, self.rotary.lookup(positions), kv_cache, meta)
        out = out + residual
        return self.shared_head.norm(out), out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(normed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The MTP module's tensors, named without their model.layers.{L}. prefix."""
        params = dict(self.named_parameters())
        expected = expected_weights(self)
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name.startswith("embed_tokens."):
                self.embed_tokens = nn.Embedding.from_pretrained(
                    tensor.to(self.enorm.weight.dtype), freeze=True
                )
                continue
            if name.startswith(_OWN):
                shard = None
            else:
                name, shard = route_deepseek_weight("layer." + name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"MTP tensor {name!r} matches no parameter of the MTP layer")
            getattr(param, "weight_loader", load_plain)(param, tensor, shard)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"speculative_config: the checkpoint's MTP layer lacks {shown}")

    def process_weights_after_loading(self) -> None:
        process_loaded_weights(self)


def load_mtp(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
    backend: AttentionBackend,
    max_len: int,
    ops: LayerOps,
) -> MTPHead:
    """The first MTP layer of a DeepSeek-V3 checkpoint folder (the target's)."""
    if cfg.architecture != "DeepseekV3ForCausalLM":
        raise ValueError(
            f"speculative_config: method 'mtp' needs a DeepSeek-V3 checkpoint with its MTP layer; "
            f"{cfg.architecture} has none"
        )
    prefix = f"model.layers.{cfg.num_layers}."
    files = safetensors_files(folder) if folder.is_dir() else []
    # only the MTP layer's tensors are read
    tensors = iter_weights(files, False, lambda name: name.startswith(prefix))
    picked = [(name.removeprefix(prefix), t) for name, t in tensors if name.startswith(prefix)]
    if not picked:
        raise ValueError(
            f"speculative_config: method 'mtp': {str(folder)!r} has no MTP layer (no {prefix}* tensors)"
        )
    with torch.device(device):
        head = MTPHead(cfg, dtype, method, backend, max_len, ops)
    head.load_weights(picked)
    head.process_weights_after_loading()
    return head
