"""Medusa heads (Cai et al. 2024), loaded from vLLM's checkpoint layout or FasterDecoding's.

Head i reads the target's final hidden state (after its final norm) at the last position the
target computed, runs it through `num_hidden_layers` residual blocks (x + SiLU(W x + b)) and
an LM head of its own, and predicts the token i + 1 places beyond the one that hidden state
predicts. One hidden state thus gives a whole chain of drafts at once, with no KV and no
pass over the drafts themselves; the heads are only as good as their training, and later
heads guess worse (the target's own LM head is the offset-0 "head").

Checkpoints: a folder with config.json and *.safetensors (or *.bin / *.pt):
- vLLM's MedusaConfig: hidden_size, vocab_size, num_heads, num_hidden_layers, optional
  truncated_vocab_size (with a `token_map` tensor of the kept target ids), original_lm_head
  (one LM head shared by every head) and medusa_fc_bias; tensors blocks.{i}.layers.{j}.weight
  (and .bias), lm_heads.{i}.weight (or lm_head.weight), optionally prefixed `medusa_heads.`.
- FasterDecoding's: medusa_num_heads, medusa_num_layers; tensors medusa_head.{i}.{j}.linear
  .weight/.bias for the blocks and medusa_head.{i}.{num_layers}.weight for the LM head.
Without the fields the target fixes (hidden_size, vocab_size) the target's are taken; the
tensors' shapes are checked against them. An original_lm_head checkpoint with no LM head
tensor shares the target's LM head.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from dolmus.config import ModelConfig
from dolmus.runtime.layers.linear import Linear
from dolmus.runtime.layers.linear_method import LinearMethod
from dolmus.runtime.loader import iter_weights, safetensors_files

_FASTER_DECODING = re.compile(r"medusa_head\.(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)")


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool, dtype: torch.dtype, method: LinearMethod):
        super().__init__()
        self.layers = nn.ModuleList(Linear(hidden, hidden, bias, dtype, method) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_layers: int,
        bias: bool,
        head_vocab: int,
        target_vocab: int,
        shared_head: bool,
        dtype: torch.dtype,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        self.num_heads, self.target_vocab = num_heads, target_vocab
        self.blocks = nn.ModuleList(
            ResidualBlock(hidden, num_layers, bias, dtype, method) for _ in range(num_heads)
        )
        # One LM head per head, or one for all (original_lm_head); none where the checkpoint
        # shares the target's without a tensor of its own: the runner sets `target_head` then.
        n_heads = 1 if shared_head else num_heads
        self.lm_heads = nn.ModuleList(
            Linear(hidden, head_vocab, False, dtype, method.head_method()) for _ in range(n_heads)
        )
        self.target_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # draft index -> target id, where the heads predict a reduced vocabulary
        self.token_map: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """Logits over the target's vocabulary of the first `count` heads: [count, B, V]."""
        out = []
        for i in range(count):
            x = self.blocks[i](hidden)
            if not self.lm_heads:
                assert self.target_head is not None, "Medusa heads sharing a target head never given"
                logits = self.target_head(x)
            else:
                logits = self.lm_heads[min(i, len(self.lm_heads) - 1)](x)
            if self.token_map is not None and logits.shape[-1] != self.target_vocab:
                full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
                full[:, self.token_map] = logits
                logits = full
            out.append(logits)
        return torch.stack(out)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()


def _field(raw: dict, *names: str) -> int | None:
    for name in names:
        if raw.get(name) is not None:
            return int(raw[name])
    return None


def _canonical(name: str, num_layers: int) -> str:
    """vLLM's name for a checkpoint tensor of either layout."""
    name = name.removeprefix("medusa_heads.")
    m = _FASTER_DECODING.fullmatch(name)
    if m is None:
        return name
    i, j, kind = int(m[1]), int(m[2]), m[3]
    if j == num_layers:
        return f"lm_heads.{i}.{kind}"
    return f"blocks.{i}.layers.{j}.{kind}"


def load_medusa(
    folder: Path,
    target: ModelConfig,
    num_speculative_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
) -> MedusaHeads:
    """Medusa heads from their folder, checked against the target they read."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config: the Medusa heads {str(folder)!r} have no config.json")
    raw = json.loads(config_file.read_text())
    # FasterDecoding's keys first: its config may also carry the base model's own fields.
    num_heads = _field(raw, "medusa_num_heads", "num_heads")
    num_layers = _field(raw, "medusa_num_layers", "num_hidden_layers")
    if num_heads is None or num_heads < 1 or num_layers is None or num_layers < 0:
        raise ValueError(
            f"speculative_config: the Medusa config {str(config_file)!r} needs num_heads >= 1 and "
            "num_hidden_layers >= 0 (or medusa_num_heads and medusa_num_layers)"
        )
    hidden = _field(raw, "hidden_size") or target.hidden_size
    if hidden != target.hidden_size:
        raise ValueError(
            f"speculative_config: the Medusa heads read hidden states of size {hidden}, the target's are "
            f"{target.hidden_size}"
        )
    vocab = _field(raw, "vocab_size") or target.vocab_size
    if vocab != target.vocab_size:
        raise ValueError(
            f"speculative_config: the Medusa heads' vocabulary ({vocab}) is not the target's "
            f"({target.vocab_size})"
        )
    if num_speculative_tokens > num_heads:
        raise ValueError(
            f"speculative_config: num_speculative_tokens ({num_speculative_tokens}) is more than the "
            f"Medusa checkpoint's {num_heads} heads (one draft per head)"
        )
    head_vocab = _field(raw, "truncated_vocab_size") or vocab

    tensors = {_canonical(name, num_layers): t for name, t in _weights(folder)}
    token_map = tensors.pop("token_map", None)
    if head_vocab < vocab and token_map is None:
        raise ValueError(
            f"speculative_config: truncated_vocab_size {head_vocab} needs a token_map tensor in the "
            "checkpoint"
        )
    if "lm_head.weight" in tensors:  # original_lm_head: one head for all
        tensors["lm_heads.0.weight"] = tensors.pop("lm_head.weight")
    shared = bool(raw.get("original_lm_head", False))
    if shared:  # vLLM reads only the first head's LM head then
        tensors = {
            n: t for n, t in tensors.items() if not n.startswith("lm_heads.") or n == "lm_heads.0.weight"
        }
    bias = raw.get("medusa_fc_bias")
    if bias is None:  # older checkpoints (FasterDecoding's, vLLM's first) always had one
        bias = any(n.startswith("blocks.") and n.endswith(".bias") for n in tensors)
    with torch.device(device):
        heads = MedusaHeads(
            hidden, num_heads, num_layers, bool(bias), head_vocab, vocab, shared, dtype, method
        )
    if shared and "lm_heads.0.weight" not in tensors:
        heads.lm_heads = nn.ModuleList()  # the runner gives it the target's
    params = dict(heads.named_parameters())
    for name, tensor in tensors.items():
        if name.startswith("lm_heads.") and token_map is not None and tensor.shape[0] == vocab > head_vocab:
            tensor = tensor[token_map.long()]  # a full-vocabulary head, cut to the kept ids
        param = params.pop(name, None)
        if param is None:
            raise ValueError(f"Medusa checkpoint tensor {name!r} matches no parameter of the heads")
        try:
            param.weight_loader(param, tensor)
        except ValueError as exc:
            raise ValueError(f"speculative_config: Medusa tensor {name!r}: {exc}") from None
    if params:
        raise ValueError(f"Medusa checkpoint lacks {', '.join(sorted(params)[:5])}")
    if token_map is not None and head_vocab < vocab:
        heads.token_map = token_map.long().to(device)
    heads.process_weights_after_loading()
    return heads


def _weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if any(folder.glob("*.safetensors")):
        yield from iter_weights(safetensors_files(folder))
        return
    files = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
    if not files:
        raise ValueError(f"speculative_config: no weights (*.safetensors, *.bin, *.pt) in {str(folder)!r}")
    for path in files:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()
