"""Decode attention of one layer: the C++ paged kernel (CPU_PAGED_CPP) against TORCH_SDPA.

What it measures: one call of each backend's decode attention for one layer, on the
workload of ``offline_throughput.py``'s "small" Llama in the middle of its decode phase:
``--num-decodes`` (32) one-token queries with context lengths uniform in
``--min-len``..``--max-len`` (300–700), block size 16, 8 query heads / 4 KV heads, head
dim 64, the pages of every request scattered over a shuffled cache:

- ``TORCH_SDPA``: ``AttentionImpl.forward_decode``, the gather (``index_select`` of every page into a
  dense padded copy) plus ``scaled_dot_product_attention`` with a length mask;
- ``CPU_PAGED_CPP``: ``paged_decode_attention_cpu``, the C++ kernel that reads K/V in place
  (``engine/model/cpu/csrc/paged_attention_cpu.cpp``), the Python checks and ctypes call included.

Both are checked to agree first. Then, for float32 and bfloat16:

- 1 thread (``torch.set_num_threads(1)``): CPU seconds per call (``time.process_time()``),
  which another process's load on the machine does not inflate;
- ``torch.get_num_threads()`` threads (all cores by default): wall seconds per call.

With ``--baseline-source FILE`` (another version of ``paged_attention_cpu.cpp``, e.g. the
last commit's), that source is built too and timed in the same loop, interleaved with the
current one: a change to the kernel is measured against what it replaces, on the same
machine and load.

``--cold`` measures a whole decode step as the worker sees it instead: ``--layers`` (8)
layers, each with its own K and V in a cache of ``--cache-mib`` (1024) MiB allocated as the
worker allocates it (one buffer, ``engine/model/cpu/huge_pages.py``), every request's pages
drawn at random from all of it, so the step's reads come from memory, not from the CPU's
caches. It times the kernel over all layers with the cache on 2 MiB pages and on 4 KiB pages
(``--baseline-source`` too, on 2 MiB pages), interleaved, bfloat16 (``--dtype``), and prints
ms per step and the GB/s of K and V read.

Each figure is the median of ``--repeats`` timings of ``--inner`` calls each. The load
average (``os.getloadavg()``) is printed before and after: above the core count, the
wall-time figures are not to be trusted.

    .venv/bin/python benchmarks/paged_attention_kernel.py
    .venv/bin/python benchmarks/paged_attention_kernel.py --repeats 50 --num-decodes 64
    git show HEAD~1:engine/model/cpu/csrc/paged_attention_cpu.cpp > /tmp/before.cpp
    .venv/bin/python benchmarks/paged_attention_kernel.py --baseline-source /tmp/before.cpp
    .venv/bin/python benchmarks/paged_attention_kernel.py --cold --num-decodes 128 --min-len 32 \\
        --max-len 768 --baseline-source /tmp/before.cpp
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.attention import Attention, AttentionMetadata  # noqa: E402
from engine.model.cpu.paged_attention_cpu import (  # noqa: E402
    build_kernel,
    kernel_path,
    load_kernel,
    open_kernel,
    paged_decode_attention_cpu,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16


def make_case(args: argparse.Namespace, dtype: torch.dtype):
    """Queries, a shuffled paged cache, and the metadata of one step of decodes."""
    g = torch.Generator().manual_seed(0)
    nd = args.num_decodes
    lens = torch.randint(args.min_len, args.max_len + 1, (nd,), generator=g)
    width = -(-args.max_len // BLOCK_SIZE)
    num_blocks = nd * width + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    table = (torch.randperm(num_blocks - 1, generator=g) + 1)[: nd * width].view(nd, width).int()
    q = torch.randn(nd, HEADS, HEAD_DIM, generator=g).to(dtype)
    seq_lens = lens.int()
    meta = AttentionMetadata(
        num_reqs=nd, num_decodes=nd, slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32), seq_lens=seq_lens, block_table=table,
        query_start_loc_cpu=list(range(nd + 1)), seq_lens_cpu=lens.tolist(),
        num_computed_tokens_cpu=(lens - 1).tolist(), max_decode_seq_len=int(lens.max()), block_size=BLOCK_SIZE,
    )  # fmt: skip
    return q, k_cache, v_cache, meta


def median_seconds(fns: list, repeats: int, inner: int, clock) -> list[float]:
    """For each of ``fns``: the median over ``repeats`` of (``clock`` time of ``inner``
    calls) / ``inner``; the functions take turns, so a change of load hits them alike."""
    for fn in fns:
        for _ in range(3):
            fn()  # warm caches, allocator and thread pool
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, series in zip(fns, times):
            start = clock()
            for _ in range(inner):
                fn()
            series.append((clock() - start) / inner)
    return [statistics.median(series) for series in times]


def cold_step(args: argparse.Namespace, baseline) -> None:
    """``--cold``: the kernel over every layer of a worker-sized cache, 2 MiB against 4 KiB pages."""
    from engine.model.cpu.huge_pages import anon_huge_bytes, zeros_on_huge_pages

    dtype = getattr(torch, args.dtype)
    item = torch.empty((), dtype=dtype).element_size()
    block_bytes = BLOCK_SIZE * KV_HEADS * HEAD_DIM * item  # one layer's K (or V) page
    num_blocks = args.cache_mib * 2**20 // (2 * args.layers * block_bytes)
    g = torch.Generator().manual_seed(0)
    nd = args.num_decodes
    lens = torch.randint(args.min_len, args.max_len + 1, (nd,), generator=g).int()
    width = -(-args.max_len // BLOCK_SIZE)
    if nd * width >= num_blocks:
        raise SystemExit(
            f"--cache-mib {args.cache_mib} holds {num_blocks} blocks a layer: too few for the decodes"
        )
    table = (torch.randperm(num_blocks - 1, generator=g) + 1)[: nd * width].view(nd, width).int()
    q = torch.randn(nd, HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = {}
    for huge in (True, False):
        before = anon_huge_bytes() or 0
        flat, _ = zeros_on_huge_pages(2 * args.layers, shape, dtype, huge=huge)
        for t in flat:
            t.normal_(generator=g)
        got = (anon_huge_bytes() or 0) - before
        caches[huge] = flat
        print(f"cache on {'2 MiB' if huge else '4 KiB'} pages: {len(flat) * flat[0].numel() * item / 2**20:.0f} MiB "
              f"({max(got, 0) / 2**20:.0f} MiB of it on huge pages per Linux)")  # fmt: skip

    def step(flat, kernel=None):
        for i in range(args.layers):
            paged_decode_attention_cpu(
                q, flat[2 * i], flat[2 * i + 1], table, lens, HEAD_DIM**-0.5, kernel=kernel
            )

    fns = {
        "2 MiB pages": functools.partial(step, caches[True]),
        "4 KiB pages": functools.partial(step, caches[False]),
    }
    if baseline is not None:
        fns["baseline source, 2 MiB pages"] = functools.partial(step, caches[True], baseline)
    read = int(lens.sum()) * KV_HEADS * HEAD_DIM * item * 2 * args.layers
    print(f"load average before: {os.getloadavg()}  (cores: {os.cpu_count()})")
    with torch.inference_mode():
        times = median_seconds(list(fns.values()), args.repeats, args.inner, time.perf_counter)
    print(f"load average after: {os.getloadavg()}")
    print(f"\n{nd} decodes of {args.min_len}-{args.max_len} keys, {args.layers} layers, {args.dtype}, "
          f"{torch.get_num_threads()} threads: {read / 2**20:.0f} MiB of K and V a step\n")  # fmt: skip
    print("| kernel, cache | ms per step | GB/s of K and V |")
    print("|---|---|---|")
    for label, t in zip(fns, times):
        print(f"| {label} | {t * 1e3:.2f} | {read / t / 1e9:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-decodes", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument(
        "--baseline-source",
        type=Path,
        help="another version of paged_attention_cpu.cpp to build and time beside the current one",
    )
    parser.add_argument(
        "--cold", action="store_true", help="a whole step over a worker-sized cache (see above)"
    )
    parser.add_argument("--layers", type=int, default=8, help="--cold: layers in the step")
    parser.add_argument("--cache-mib", type=int, default=1024, help="--cold: the cache's size, all layers")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--cold: the dtype"
    )
    args = parser.parse_args()

    load_kernel()
    baseline = None
    if args.baseline_source:
        so = Path(tempfile.mkdtemp(prefix="glassbox-kernel-")) / "baseline.so"
        build_kernel(args.baseline_source, so)
        baseline = open_kernel(so)
        print(f"baseline kernel: built from {args.baseline_source}")
    if args.cold:
        if args.repeats == parser.get_default("repeats") and args.inner == parser.get_default("inner"):
            args.repeats, args.inner = 9, 1
        cold_step(args, baseline)
        return
    threads = torch.get_num_threads()
    layer = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5)
    print(f"kernel: {kernel_path()}")
    print(
        f"workload: {args.num_decodes} decodes, seq_lens uniform in {args.min_len}-{args.max_len}, "
        f"block {BLOCK_SIZE}, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}"
    )
    print(f"load average before: {os.getloadavg()}  (cores: {os.cpu_count()})")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k_cache, v_cache, meta = make_case(args, dtype)
        sdpa = functools.partial(layer.impl.forward_decode, q, (k_cache, v_cache), meta)
        call = functools.partial(
            paged_decode_attention_cpu, q, k_cache, v_cache, meta.block_table, meta.seq_lens, layer.scale
        )
        fns = [sdpa, call]
        if baseline is not None:
            fns.append(functools.partial(call, kernel=baseline))
        with torch.inference_mode():
            diff = (sdpa().float() - call().float()).abs().max().item()
            for label, n, clock in (("1 thread, CPU ms", 1, time.process_time), (f"{threads} threads, wall ms", threads, time.perf_counter)):  # fmt: skip
                torch.set_num_threads(n)
                times = median_seconds(fns, args.repeats, args.inner, clock)
                rows.append((str(dtype).removeprefix("torch."), label, [t * 1e3 for t in times], diff))
            torch.set_num_threads(threads)
    print(f"load average after: {os.getloadavg()}")
    print()
    extra = " | baseline CPU_PAGED_CPP | speed-up over it" if baseline is not None else ""
    print(f"| dtype | timing | TORCH_SDPA _decode | CPU_PAGED_CPP | speed-up | max abs diff{extra} |")
    print("|---|---|---|---|---|---|" + ("---|---|" if baseline is not None else ""))
    for dtype, label, times, diff in rows:
        a, b = times[0], times[1]
        line = f"| {dtype} | {label} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {diff:.1e}"
        if baseline is not None:
            line += f" | {times[2]:.3f} | {times[2] / b:.2f}x"
        print(line + " |")


if __name__ == "__main__":
    main()
