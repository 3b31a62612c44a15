"""The KV cache's memory: one buffer advised onto 2 MiB pages, each layer's K and V a view."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.cpu.huge_pages import HUGE_PAGE_BYTES, anon_huge_bytes, zeros_on_huge_pages

SHAPE = (64, 16, 4, 64)  # (num_blocks, block_size, kv_heads, head_dim): 512 KiB of bfloat16


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize("huge", [True, False])
def test_the_tensors_are_zeroed_contiguous_and_do_not_overlap(huge):
    tensors, _ = zeros_on_huge_pages(6, SHAPE, torch.bfloat16, huge=huge)
    assert [t.shape for t in tensors] == [torch.Size(SHAPE)] * 6
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in tensors)
    assert all(t.count_nonzero() == 0 for t in tensors)
    tensors[2].fill_(1.5)  # a layer's K written: no other layer's K or V changes
    assert [float(t.float().sum()) for t in tensors] == [0, 0, 1.5 * tensors[2].numel(), 0, 0, 0]


def test_without_huge_pages_nothing_is_advised():
    _, advised = zeros_on_huge_pages(2, SHAPE, torch.float32, huge=False)
    assert advised == 0


def _thp_fallbacks() -> int:
    """How many times Linux has fallen back to 4 KiB pages where a huge page was wanted
    (``thp_fault_fallback`` of ``/proc/vmstat``, the whole machine's count)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_linux_backs_the_cache_with_huge_pages_where_thp_allows():
    before, fallbacks = anon_huge_bytes(), _thp_fallbacks()
    # 1 MiB of float32 per tensor, 40 MiB in all: over glibc's largest mmap threshold (32 MiB),
    # so the buffer is a fresh mapping. A smaller one may reuse heap memory an earlier test
    # touched (after large frees glibc raises its threshold), and Linux backs touched memory
    # with the 4 KiB pages it has, advice or not (a fresh-clone run met that).
    shape = (64, 16, 4, 64)
    tensors, advised = zeros_on_huge_pages(40, shape, torch.float32)
    assert advised == 40 * 2**20 // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    after = anon_huge_bytes()
    assert before is not None and after is not None
    if after - before < HUGE_PAGE_BYTES and _thp_fallbacks() > fallbacks:
        # Linux found no free 2 MiB page (memory fragmented by the other tests' processes: a
        # fresh-clone run met it once) and said so; the advice itself was given.
        pytest.skip(
            f"Linux fell back to 4 KiB pages {_thp_fallbacks() - fallbacks} time(s): no free 2 MiB page"
        )
    # Not advised (or advised too late, after the first touch): no huge page and no fallback.
    assert after - before >= HUGE_PAGE_BYTES, "no 2 MiB page backs the advised cache"
    del tensors
