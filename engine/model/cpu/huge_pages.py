"""The KV cache on 2 MiB pages (Linux transparent huge pages), where the kernel allows it.

Decode attention reads every request's K and V pages each step, and the pages of one request
lie scattered over a cache of a GiB or more. On 4 KiB pages every 8 KiB KV block costs two
TLB misses, each a walk of the page tables before the read can start; on 2 MiB pages the
cache's whole working set fits in the TLB. Measured on the AMX Xeon (docs/performance.md,
"Decode attention"; ``benchmarks/paged_attention_kernel.py --cold``): the C++ paged kernel
over 128 decodes of 32–768 keys, 8 layers of a 1 GiB bfloat16 cache, 1.8–2× faster a step.

Linux gives a mapping huge pages at its first touch when the mapping was advised
``MADV_HUGEPAGE`` and ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise`` (the common default). So the cache is one buffer, over-allocated by 2 MiB,
advised from its first 2 MiB boundary, and only then zeroed (the touch); each layer's K
and V are views of it. Where the advice is refused (another OS, THP ``never``, a kernel
without THP) the buffer is the same zeroed memory on small pages: nothing else changes.
A buffer under glibc's mmap threshold (which it raises up to 32 MiB after large frees) may
come from heap memory touched before: Linux leaves that on its 4 KiB pages, advice or not —
only tiny caches, where the TLB matters least.

PyTorch's own switch, ``THP_MEM_ALLOC_ENABLE=1``, advises every CPU allocation of 2 MiB or
more — the step's activations too, which then fault in fresh 2 MiB pages (each zeroed by the
kernel) every step: measured no faster overall, so Glassbox advises the cache alone.
vLLM: none (its CPU worker allocates the cache with ``torch.zeros``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Sequence

import torch

from engine.logger import init_logger

logger = init_logger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20
MADV_HUGEPAGE = 14  # linux/mman.h

_libc: ctypes.CDLL | None = None


def _madvise_huge(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_HUGEPAGE)``; True where Linux took the advice."""
    global _libc
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(address, length, MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(
    count: int, shape: Sequence[int], dtype: torch.dtype, huge: bool = True
) -> tuple[list[torch.Tensor], int]:
    """``count`` zeroed, contiguous CPU tensors of ``shape`` and ``dtype``, views of one buffer
    advised onto 2 MiB pages (unless ``huge`` is False).

    Returns:
        (tensors, advised bytes): the bytes of the buffer Linux was asked to back with huge
        pages — 0 where it refused the advice or ``huge`` is False (the tensors are then
        ordinary memory). Whether it found free 2 MiB pages is Linux's to say
        (``AnonHugePages`` in ``/proc/<pid>/smaps``).

    Raises:
        RuntimeError: the allocation failed (out of memory), as ``torch.zeros`` would.
    """
    item = torch.empty((), dtype=dtype).element_size()
    each = math.prod(shape) * item  # bytes of one tensor (a multiple of the element size)
    total = each * count
    pad = HUGE_PAGE_BYTES if huge else 0
    raw = torch.empty(total + pad, dtype=torch.uint8)  # untouched: no page is backed yet
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES if huge else 0
    advised = 0
    if huge:
        length = total // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        advised = length if _madvise_huge(raw.data_ptr() + start, length) else 0
    region = raw[start : start + total]
    region.zero_()  # the first touch: Linux backs the advised range with 2 MiB pages here
    tensors = [region[i * each : (i + 1) * each].view(dtype).view(tuple(shape)) for i in range(count)]
    return tensors, advised


def allocate_kv_cache(
    count: int, shape: Sequence[int], dtype: torch.dtype, huge: bool
) -> tuple[list[torch.Tensor], str]:
    """A CPU worker's KV cache: ``zeros_on_huge_pages``, then how much of it Linux put on
    2 MiB pages, logged and returned in words for the worker's runs-as (``glassbox ps``):
    ``2 MiB pages``, ``2 MiB pages (x of y MiB)`` where Linux found fewer, or ``4 KiB pages
    (why)``. ``huge``: ``GLASSBOX_CPU_KV_HUGE_PAGES``."""
    before = anon_huge_bytes() if huge else None
    tensors, advised = zeros_on_huge_pages(count, shape, dtype, huge=huge)
    total = sum(t.numel() * t.element_size() for t in tensors)
    if not huge:
        pages = "4 KiB pages (GLASSBOX_CPU_KV_HUGE_PAGES=0)"
    elif total < HUGE_PAGE_BYTES:
        pages = "4 KiB pages (the cache is under 2 MiB)"
    elif not advised:
        pages = "4 KiB pages (transparent huge pages off)"
    else:
        after = anon_huge_bytes()
        got = None if before is None or after is None else min(max(0, after - before), total)
        amount = "?" if got is None else f"{got / 2**20:.0f}"
        logger.info("KV cache: %s of %.0f MiB on 2 MiB pages (transparent huge pages, advised)",
                    amount + " MiB", total / 2**20)  # fmt: skip
        if got is not None and got >= advised:  # every whole 2 MiB page of the buffer
            return tensors, "2 MiB pages"
        return tensors, f"2 MiB pages ({amount} of {total / 2**20:.0f} MiB)"
    logger.info("KV cache on %s", pages)
    return tensors, pages


def anon_huge_bytes() -> int | None:
    """This process's anonymous memory on huge pages (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``), in bytes; None where Linux does not report it."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
