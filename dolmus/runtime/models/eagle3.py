"""EAGLE-3 draft heads, loaded from the public checkpoint layout (SafeAILab's EAGLE-3, as vLLM
and SGLang read it).

A head is one decoder layer that sees, at position p, the embedding of the token at p + 1 and
a feature of position p: for positions the target computed, `fc` of the residual stream
entering three of its layers (low, middle, high; `eagle_aux_hidden_state_layer_ids`, by
default 2, L / 2 and L - 3); for positions it only guessed, the head's own output at the
position before. Its attention's q/k/v read both halves concatenated (2 x hidden inputs). It
predicts the token at p + 2 over a reduced vocabulary (`draft_vocab_size`), which `d2t`
maps back to the target's (target id = draft id + d2t[draft id]). It shares the target's
embedding unless the checkpoint brings its own.

Checkpoint names: fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
.weight, midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
norm.weight, lm_head.weight, d2t (t2d is not needed); config.json with the head's Llama
fields plus draft_vocab_size and, optionally, eagle_config.eagle_aux_hidden_state_layer_ids
and target_hidden_size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dolmus.config import ModelConfig
from dolmus.distributed.parallel_config import SINGLE_RANK
from dolmus.runtime.attention import AttentionBackend, AttentionMetadata
from dolmus.runtime.attention.kv_store import PagedKV
from dolmus.runtime.layers.linear import Linear, load_plain
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.layers.norm import RMSNorm
from dolmus.runtime.layers.ops import LayerOps
from dolmus.runtime.layers.rotary import RotaryEmbedding
from dolmus.runtime.loader import iter_weights, safetensors_files
from dolmus.runtime.models.llama import MLP, Attention, expected_weights, fused_name


class Eagle3Head(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        target_hidden: int,
        aux_layers: tuple[int, ...],
        draft_vocab: int,
        target_vocab: int,
        dtype: torch.dtype,
        method: LinearMethod,
        backend: AttentionBackend,
        max_len: int,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg, self.aux_layers, self.target_vocab = cfg, aux_layers, target_vocab
        self.fc = Linear(len(aux_layers) * target_hidden, h, False, dtype, method)
        self.embed_tokens: nn.Module | None = None  # the target's, unless the checkpoint has one
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(cfg, dtype, method, backend, SINGLE_RANK, ops)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.self_attn.qkv_proj = Linear(2 * h, {"q": q, "k": kv, "v": kv}, cfg.attention_bias, dtype, method)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.mlp = MLP(cfg, dtype, method, SINGLE_RANK, ops)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.lm_head = Linear(h, draft_vocab, False, dtype, method.head_method())
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    # the runner hands it the hidden states of the target's layers it captured (aux_layers)
    reads_final_hidden = False

    def kv_layout(self) -> tuple[int, int, int | None]:
        """Its one layer's KV heads, head size and (None) values alike."""
        return self.cfg.kv_layout()

    def combine(self, captured: torch.Tensor) -> torch.Tensor:
        """The feature of positions the target computed: fc of its captured layers."""
        return self.fc(captured)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, output before the final norm: the feature of the
        next position when the target has not computed it)."""
        assert self.embed_tokens is not None
        embeds = self.input_layernorm(self.embed_tokens(input_ids))
        x = torch.cat((embeds, self.hidden_norm(features)), dim=-1)
        residual = features + self.self_attn(x, self.rotary.lookup(positions), kv_cache, meta)
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return self.norm(out), out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (-inf where the draft vocabulary has no token)."""
        logits = self.lm_head(normed)
        full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        full[:, torch.arange(logits.shape[1]) + self.d2t] = logits
        return full

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        expected = expected_weights(self)
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name == "t2d":
                continue
            if name == "d2t":
                self.d2t.copy_(tensor.long())
                continue
            if name.startswith("embed_tokens.") or name.startswith("model.embed_tokens."):
                self.embed_tokens = nn.Embedding.from_pretrained(
                    tensor.to(self.norm.weight.dtype), freeze=True
                )
                continue
            name, shard = fused_name(
                name.removeprefix("model.").replace("midlayer.", "").replace("layers.0.", "")
            )
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} matches no parameter of the head")
            getattr(param, "weight_loader", load_plain)(param, tensor, shard)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint lacks {', '.join(missing[:5])}")

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()


def load_eagle3(
    folder: Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
    backend: AttentionBackend,
    max_len: int,
    ops: LayerOps,
) -> Eagle3Head:
    """An EAGLE-3 head from its folder (config.json and safetensors or pytorch_model.bin)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config: the EAGLE-3 head {str(folder)!r} has no config.json")
    raw = json.loads(config_file.read_text())
    # The head's layer is a Llama layer: its fields parse as one (its own architecture name
    # is not a model we run).
    cfg = replace(ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}), num_layers=1)
    if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head's vocabulary ({raw.get('vocab_size')}) is not the "
            f"target's ({target.vocab_size})"
        )
    layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(layers) if layers else (2, n // 2, n - 3)
    if any(not 0 <= i < n for i in aux):
        raise ValueError(
            f"speculative_config: EAGLE-3 auxiliary layers {aux} are not layers of a {n}-layer target"
        )
    target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head reads hidden states of size {target_hidden}, "
            f"the target's are {target.hidden_size}"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
    with torch.device(device):
        head = Eagle3Head(
            cfg, target_hidden, aux, draft_vocab, target.vocab_size, dtype, method, backend, max_len, ops
        )
    head.load_weights(_weights(folder))
    head.process_weights_after_loading()
    return head


def _weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        yield from iter_weights(safetensors_files(folder))
        return
    bins = sorted(folder.glob("*.bin"))
    if not bins:
        raise ValueError(f"speculative_config: no weights (*.safetensors, *.bin) in {str(folder)!r}")
    for path in bins:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()
