"""Weights in transparent huge pages (2 MiB), where Linux offers them.

A decode step streams every weight once, so how fast weights stream is how fast a step is.
On 4 KiB pages the stream needs a new TLB entry every 4 KiB, and under a hypervisor each miss
walks two page tables; on 2 MiB pages it needs one per 2 MiB. Measured on this project's
2-core VM (Intel Xeon with AMX): the bf16 products of 24 Qwen2.5-0.5B layers at one row 36-38
-> 32-35 ms, and a 64 MiB read right after two idle seconds 57-60 -> 9-14 ms (that host makes
pages left untouched for a second slow to touch again, ~70 us each at 4 KiB).

Only what is written once and then read for the model's life goes here (packed weights):
memory that is touched for the first time while serving (the KV pool) stays on small pages,
since a huge-page fault zeroes 2 MiB at once (kv_store.py). PyTorch's allocator does the same
for every allocation with THP_MEM_ALLOC_ENABLE=1; this is that, for the weights alone.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:
    if platform.system() != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def anonymous(nbytes: int) -> torch.Tensor:
    """`nbytes` of private anonymous memory as a uint8 tensor: zero pages that become resident
    on first touch (shared memory would follow another THP setting). The tensor, and any view
    of it, keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor on huge pages where the size (>= 2 MiB) and the system
    allow; else torch.empty. The memory is released with the last tensor viewing it."""
    nbytes = numel * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(numel, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = anonymous(size + HUGE_PAGE)  # one page more, so a 2 MiB-aligned stretch fits
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, size, _MADV_HUGEPAGE)  # a refusal leaves small pages: still correct
    return raw[start : start + nbytes].view(dtype)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on huge pages (where empty() gives them), same shape."""
    out = empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out
