"""Packed weights on transparent huge pages (runtime/huge_pages.py)."""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import pytest
import torch

from dolmus.runtime import huge_pages

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="madvise(MADV_HUGEPAGE) is Linux's")


def _thp_offered() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@linux_only
def test_a_large_tensor_starts_on_a_huge_page_boundary_and_outlives_its_mapping_object() -> None:
    t = huge_pages.empty(3 * huge_pages.HUGE_PAGE // 2 + 7, torch.bfloat16)
    assert t.shape == (3 * huge_pages.HUGE_PAGE // 2 + 7,) and t.dtype == torch.bfloat16
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    gc.collect()  # only the tensor holds the mapping now
    t.copy_(torch.arange(t.numel()).bfloat16())
    assert torch.equal(t[-3:], torch.arange(t.numel())[-3:].bfloat16())


@linux_only
@pytest.mark.skipif(not _thp_offered(), reason="transparent huge pages are off on this system")
def test_the_kernel_backs_it_with_huge_pages() -> None:
    def anon_huge_kb() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    before = anon_huge_kb()
    t = huge_pages.empty(8 * huge_pages.HUGE_PAGE, torch.uint8)
    t.fill_(1)  # the first touch faults the pages in
    # the kernel may fall short of free 2 MiB frames for some of the 16 MiB: at least one is huge
    assert anon_huge_kb() - before >= 2 * 1024
    del t


def test_small_tensors_are_ordinary() -> None:
    t = huge_pages.empty(1000, torch.float32)
    assert t.shape == (1000,) and t.dtype == torch.float32
