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

Each figure is the median of ``--repeats`` timings of ``--inner`` calls each. The load
average (``os.getloadavg()``) is printed before and after: above the core count, the
wall-time figures are not to be trusted.

    .venv/bin/python benchmarks/paged_attention_kernel.py
    .venv/bin/python benchmarks/paged_attention_kernel.py --repeats 50 --num-decodes 64
    git show HEAD~1:engine/model/cpu/csrc/paged_attention_cpu.cpp > /tmp/before.cpp
    .venv/bin/python benchmarks/paged_attention_kernel.py --baseline-source /tmp/before.cpp
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
    args = parser.parse_args()

    load_kernel()
    baseline = None
    if args.baseline_source:
        so = Path(tempfile.mkdtemp(prefix="glassbox-kernel-")) / "baseline.so"
        build_kernel(args.baseline_source, so)
        baseline = open_kernel(so)
        print(f"baseline kernel: built from {args.baseline_source}")
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
