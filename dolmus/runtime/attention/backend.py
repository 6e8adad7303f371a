"""The contract between a model's attention layers and the paged KV cache.

The model runner describes a step once (`AttentionMetadata`); every layer then calls the
backend with its own q/k/v and its own cache tensor. Layout of one layer's cache:
`[2, num_blocks * block_size, num_kv_heads, head_dim]` (keys, then values), addressed by
slot = block_id * block_size + offset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dolmus.runtime.attention.kv_store import PagedKV


@dataclass
class PrefillSeq:
    """A sequence with more than one new token (a prompt or a chunk of one)."""

    query_start: int  # first of its tokens in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks holding context + chunk; None if context_len == 0
    mask: torch.Tensor | None  # [query_len, context_len + query_len] causal, when block_ids is set


@dataclass
class DecodeGroup:
    """Decodes of similar length, attended as one padded batch.

    Grouping by length keeps padding (wasted gathers and dot products) small when short
    and long sequences decode together.
    """

    start: int  # first of the group's tokens in the flat batch
    count: int
    num_blocks: int  # blocks per sequence after padding
    block_ids: torch.Tensor  # [count * num_blocks], row-major
    mask: torch.Tensor  # [count, 1, 1, num_blocks * block_size], 0 or -inf (model dtype)
    lengths: torch.Tensor  # [count] int64: cached positions each sequence attends to


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each of them may attend to.

    The flat batch holds decodes first (one token each, in their groups), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Writes k/v to the cache, returns [T, Hq * D].

        All new keys and values of the step are written before any sequence reads the
        cache: a request admitted in the same step as another may share its fresh blocks.
        """


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str = "torch", **options: bool) -> AttentionBackend:
    # Imported here so the registry fills without the backends importing each other.
    from dolmus.runtime.attention import torch_sdpa  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name](**options)
