"""One layer's paged key/value storage: plain, or quantized with a scale per token and head.

Attention backends write a step's keys and values by slot and read whole blocks back in
the compute dtype; how they are stored is this module's business. Quantized storage
(`int8`, or `fp8` = float8 e4m3) keeps one scale per (token, KV head), so a block never
needs requantizing as it fills and outliers in one head do not blur the others; at
head_dim 64 it holds ~1.9x the tokens of bf16 in the same bytes.

Multi-head latent attention (DeepSeek's MLA, runtime/models/mla.py) caches one vector per token
instead of per-head keys and values: the compressed latent followed by the shared rotated key
(`LatentPagedKV`). Its keys are that whole vector (one "head"), its values the latent part of
the same storage, so the pool holds each number once.
"""

from __future__ import annotations

import math

import torch

from dolmus.runtime import huge_pages

_CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# fp8 codes live in uint8 storage: CPU index_copy_ has no float8 kernel.
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
_MAX = {"int8": 127.0, "fp8": 448.0}


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On the CPU it is an anonymous memory map: the kernel hands out zero pages
    on first touch, so the pool costs no start-up time (filling a 4 GiB pool took 7 s here, the
    longest part of loading a small model) and becomes resident as blocks are first used, up to
    its budget (the planner checks the budget against the memory available). Plain 4 KiB pages:
    with MADV_HUGEPAGE, first writes into fresh blocks stalled on 2 MiB faults (and compaction),
    56 ms of a 290 ms prefill step of 512 tokens here against 4 ms on small pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return huge_pages.anonymous(nbytes).view(dtype).view(shape)


class PagedKV:
    def __init__(
        self,
        slots: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        storage: torch.dtype | None = None,
    ) -> None:
        """`dtype` is what attention computes in; `storage` what the cache holds (default: dtype)."""
        self.data = zeros((2, slots, num_kv_heads, head_dim), storage or dtype, device)
        self.block_size = block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.data[0].index_copy_(0, slots, k)
        self.data[1].index_copy_(0, slots, v)

    def blocks(self, which: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Keys (0) or values (1) of whole blocks: [len(block_ids) * block_size, Hkv, D]."""
        _, _, heads, dim = self.data.shape
        flat = self.data[which].view(-1, self.block_size * heads * dim)
        return flat.index_select(0, block_ids).view(-1, heads, dim)


class QuantizedPagedKV(PagedKV):
    def __init__(
        self,
        slots: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kind: str,
    ) -> None:
        super().__init__(slots, num_kv_heads, head_dim, block_size, dtype, device, _STORAGE[kind])
        self.scale = zeros((2, slots, num_kv_heads), dtype, device)
        self.max_code = _MAX[kind]
        self.is_int = kind == "int8"
        self.codes_dtype = _CODES[kind]

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:  # type: ignore[override]
        scale = torch.empty((), dtype=dtype).element_size()
        return 2 * num_kv_heads * (head_dim + scale)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (x.float().abs().amax(-1) / self.max_code).clamp(min=1e-8)
        codes = x.float() / scale.unsqueeze(-1)
        codes = codes.round().clamp(-128, 127) if self.is_int else codes.clamp(-448, 448)
        return codes.to(self.codes_dtype).view(self.data.dtype), scale.to(self.dtype)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for which, x in ((0, k), (1, v)):
            codes, scale = self._quantize(x)
            self.data[which].index_copy_(0, slots, codes)
            self.scale[which].index_copy_(0, slots, scale)

    def blocks(self, which: int, block_ids: torch.Tensor) -> torch.Tensor:
        _, _, heads, dim = self.data.shape
        codes = self.data[which].view(-1, self.block_size * heads * dim).index_select(0, block_ids)
        scale = self.scale[which].view(-1, self.block_size * heads).index_select(0, block_ids)
        return codes.view(self.codes_dtype).view(-1, heads, dim).to(self.dtype) * scale.view(-1, heads, 1)


class LatentPagedKV(PagedKV):
    """One vector of `width` numbers per token (MLA: latent, then rotated key); the keys are
    the whole vector, the values its first `value_dim` numbers (a view: nothing stored twice)."""

    def __init__(
        self,
        slots: int,
        width: int,
        value_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.data = zeros((1, slots, 1, width), dtype, device)
        self.block_size = block_size
        self.dtype = dtype
        self.value_dim = value_dim

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # v is the first value_dim numbers of k: written once, with k
        self.data[0].index_copy_(0, slots, k)

    def blocks(self, which: int, block_ids: torch.Tensor) -> torch.Tensor:
        whole = super().blocks(0, block_ids)
        return whole if which == 0 else whole[..., : self.value_dim]


def _check_latent(kind: str) -> None:
    if kind != "auto":
        raise ValueError(
            f"kv_cache_dtype {kind!r} is not supported for multi-head latent attention (DeepSeek) "
            "models; use 'auto' (their latent cache is already ~9x smaller than per-head K/V)"
        )


def make_kv_store(
    kind: str,
    slots: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    value_dim: int | None = None,
) -> PagedKV:
    """`value_dim` set: a latent cache (MLA), one vector of `head_dim` numbers per token whose
    first `value_dim` are the values (`num_kv_heads` must then be 1)."""
    if value_dim is not None:
        _check_latent(kind)
        return LatentPagedKV(slots, head_dim, value_dim, block_size, dtype, device)
    if kind == "auto":
        return PagedKV(slots, num_kv_heads, head_dim, block_size, dtype, device)
    return QuantizedPagedKV(slots, num_kv_heads, head_dim, block_size, dtype, device, kind)


def kv_bytes_per_token(
    kind: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype, latent: bool = False
) -> int:
    """Bytes one token takes in one layer's cache (`latent`: an MLA cache, see make_kv_store)."""
    if latent:
        _check_latent(kind)
        return LatentPagedKV.bytes_per_token(num_kv_heads, head_dim, dtype)
    store = PagedKV if kind == "auto" else QuantizedPagedKV
    return store.bytes_per_token(num_kv_heads, head_dim, dtype)
