"""The contract between a model's attention layers and the paged KV cache.

The model runner describes a step once in backend-neutral terms (`BatchLayout`: query
lengths, context lengths, block-table rows, slot mapping); the backend turns that into its
own metadata (`build_metadata`), and every layer then calls the backend with its own q/k/v
and its own cache tensor. Layout of one layer's cache:
`[2, num_blocks * block_size, num_kv_heads, head_dim]` (keys, then values), addressed by
slot = block_id * block_size + offset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dolmus.runtime.attention.kv_store import PagedKV

# What a backend's build_metadata returns; layers pass it through without looking inside.
AttentionMetadata = Any


@dataclass
class BatchLayout:
    """The step's sequences, as the runner lays them out (CPU tensors).

    Sequences are in batch order: the first `num_decodes` have one new token each, sorted by
    context length; the rest are prefill chunks. Token i of the flat batch belongs to the
    sequence whose [query_start, query_start + query_len) holds i.
    """

    num_decodes: int
    query_lens: torch.Tensor  # [num_seqs] int64: new tokens of each sequence
    context_lens: torch.Tensor  # [num_seqs] int64: tokens already in its cache before this step
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64: enough columns for every sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_size: int

    @property
    def query_start_loc(self) -> torch.Tensor:
        """[num_seqs + 1] int64: where each sequence's tokens start in the flat batch."""
        return torch.nn.functional.pad(self.query_lens.cumsum(0), (1, 0))


class AttentionBackend(ABC):
    name: str
    # CUDA graphs replay fixed buffers: a backend that supports them describes a decode-only step
    # by tensors it reads in place (graph_metadata), which runtime/cuda_graphs.py refills per step.
    supports_cuda_graphs: ClassVar[bool] = False

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device, dtype: torch.dtype) -> Any:
        """This backend's description of the step, built once and passed to every layer."""

    def graph_metadata(
        self, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> Any:
        """Metadata for a decode-only step of len(seq_lens) rows (one new token each) that reads
        these device tensors in place, whatever they hold when a captured graph replays:
        slot_mapping [rows], block_table [rows, width] and seq_lens [rows] (keys each row
        attends to, its new one included; 0 for a padding row, which must stay finite)."""
        raise NotImplementedError(f"the {self.name} attention backend does not capture CUDA graphs")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Writes k/v to the cache, returns [T, Hq * D].

        All new keys and values of the step are written before any sequence reads the
        cache: a request admitted in the same step as another may share its fresh blocks.
        `window`: the query at position p attends only to keys in (p - window, p] (sliding-window
        attention, as transformers' masks have it). Blocks wholly before every query's window
        may have been freed and reused by other requests (engine/kv_cache.py): a backend must
        give them no weight.
        """


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    _import_backends()
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    _import_backends()
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def _import_backends() -> None:
    # Imported here so the registry fills without the backends importing each other.
    from dolmus.runtime.attention import native_cpu, torch_sdpa, triton_backend  # noqa: F401
