"""A hand-written C++ paged decode-attention kernel for CPUs (``--attention-backend CPU_PAGED_CPP``).

vLLM counterpart: ``paged_attention_v1`` (``csrc/cpu/attention.cpp`` in its CPU build,
``csrc/attention/attention_kernels.cu`` on GPUs), reached through ``torch.ops._C``.

The kernel is ``csrc/paged_attention_cpu.cpp``: plain C++ with C linkage and no torch
headers, built on first use into ``<GLASSBOX_CACHE_ROOT>/kernels/paged_attention_cpu-<hash>.so``
(``kernel_build.py``: ``g++ -O3 -march=native -fopenmp``, the hash covering the source, the
compiler, the flags and the CPU's instruction sets) and called through ``ctypes`` with the
tensors' data pointers. Building takes a second or two; ``CPUPagedCppBackend.prepare``
(``attention_backends.py``) does it at start-up. The kernel shares torch's OpenMP runtime;
each call runs ``torch.get_num_threads()`` threads, as torch's own ops do.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from engine.model.cpu.kernel_build import build, kernel_file, missing_compiler

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's `dtype` argument
_MAX_GROUP = 64  # query heads per KV head the kernel accepts (its fixed-size arrays)

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()
# Decodes per thread from which one task takes all of a request's KV heads (the AVX-512
# path's task shape): set from ``choose_task_shape``'s verdict by the worker; None: the
# kernel's default (2).
all_heads_from: int | None = None


def cpp_kernel_unavailable() -> str | None:
    """Why the kernel cannot be used here (not built yet, and no C++ compiler on PATH), or
    None. Builds nothing."""
    if _lib is not None or kernel_path().exists():
        return None
    return missing_compiler()


def kernel_path() -> Path:
    """Where the built kernel lives (or will): ``<cache>/kernels/paged_attention_cpu-<hash>.so``
    (``kernel_build.kernel_file``)."""
    return kernel_file(SOURCE)


def build_kernel(source: Path, so: Path) -> None:
    """Compile ``source`` into the shared library ``so`` (``kernel_build.build``).

    Raises:
        RuntimeError: no C++ compiler, or the build failed (the message holds the command
            and the compiler's stderr).
    """
    build(source, so, "the CPU_PAGED_CPP attention kernel")


def open_kernel(so: Path) -> ctypes.CDLL:
    """Load a built kernel and declare its C signature (ctypes then converts and checks
    each argument). Raises ``OSError`` when ``so`` cannot be loaded."""
    lib = ctypes.CDLL(str(so))
    fn = lib.glassbox_paged_decode_attention
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [
        i32,  # dtype: 0 float32, 1 bfloat16
        p,  # q
        p,  # k_cache
        p,  # v_cache
        p,  # block_table (int32)
        i64,  # block_table_stride: elements between two rows
        i32,  # block_table_width: entries in a row
        i32,  # num_blocks in each cache
        p,  # seq_lens (int32)
        i32,  # num_decodes
        i32,  # num_heads
        i32,  # num_kv_heads
        i32,  # head_dim
        i32,  # block_size
        i32,  # sliding_window (0: none)
        ctypes.c_float,  # scale
        p,  # out
        i32,  # num_threads
        i32,  # all_heads_from: decodes per thread from which a task takes all KV heads (0: default)
    ]
    fn.restype = i32
    return lib


def load_kernel() -> ctypes.CDLL:
    """Build the kernel unless it is cached (``kernel_path``), load it, and return the library.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (see ``build_kernel``).
    """
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        so = kernel_path()
        if not so.exists():
            build_kernel(SOURCE, so)
        _lib = open_kernel(so)
        return _lib


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kernel: ctypes.CDLL | None = None,
    task_shape: int | None = None,
) -> torch.Tensor:
    """One query token per request, attending to K/V read in place from the paged cache.

    Args:
        q: ``(num_decodes, num_heads, head_dim)``, float32 or bfloat16, contiguous.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, contiguous,
            ``q``'s dtype. ``num_kv_heads`` divides ``num_heads`` (grouped-query attention:
            query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
        block_table: ``(num_decodes, max_blocks_per_req)`` int32 (rows may be a slice of a
            larger table: only the last dimension must be contiguous), each request's block
            ids; it must cover ``seq_lens`` (entries past a request's last block are unread).
            The kernel checks, before reading anything, that every block it needs exists.
        seq_lens: ``(num_decodes,)`` int32, the keys each request has (the query is the last).
        scale: multiplier of ``q·k``.
        sliding_window: when set, a request sees only its last ``sliding_window`` keys.
        kernel: another build of the kernel (``build_kernel`` + ``open_kernel``: a benchmark
            comparing two versions of the source); by default the cached one (``load_kernel``).
        task_shape: decodes per thread from which one task takes all of a request's KV heads
            (the AVX-512 path); by default this process's ``all_heads_from`` (the worker's
            measured verdict), else the kernel's own default, 2.

    Returns ``(num_decodes, num_heads, head_dim)`` in ``q``'s dtype. Scores, softmax and the
    weighted sum are float32; a bfloat16 output is rounded to nearest, ties to even.

    Raises:
        ValueError: a tensor not on the CPU, of another dtype or shape than above, or not
            contiguous (a cache view, e.g. a slice of blocks' rows, must be made contiguous);
            a ``seq_len`` beyond its block-table row, a negative one, or a block id outside
            the cache.
        RuntimeError: the kernel cannot be built (see ``load_kernel``).

    vLLM: ``paged_attention_v1`` (one block-table walk per request and head, logits kept
    whole, then the softmax and the weighted sum of values).
    """
    fn = (kernel if kernel is not None else load_kernel()).glassbox_paged_decode_attention
    _check(q, k_cache, v_cache, block_table, seq_lens, sliding_window)
    nd, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if nd == 0:
        return out
    rc = fn(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        block_table.shape[1],
        k_cache.shape[0],
        seq_lens.data_ptr(),
        nd,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        sliding_window or 0,
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
        task_shape if task_shape is not None else (all_heads_from or 0),
    )
    if rc == -2:
        raise ValueError(
            "paged_decode_attention_cpu: a request's seq_len needs more blocks than its block_table row "
            f"holds ({block_table.shape[1]}), or a block id is outside the cache ({k_cache.shape[0]} blocks)"
        )
    if rc != 0:  # _check refuses every other argument the kernel would refuse: a bug if seen
        raise RuntimeError(f"glassbox_paged_decode_attention returned {rc}")
    return out


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """Refuse what the kernel would read wrongly (it trusts its pointers and sizes)."""
    tensors = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "seq_lens": seq_lens,
    }
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(
                f"paged_decode_attention_cpu: {name} is on {t.device}; the kernel runs on the CPU"
            )
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"paged_decode_attention_cpu: dtype {q.dtype} is not supported (float32, bfloat16)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"paged_decode_attention_cpu: q, k_cache and v_cache must share a dtype "
            f"({q.dtype}, {k_cache.dtype}, {v_cache.dtype})"
        )
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "paged_decode_attention_cpu: q must be (num_decodes, num_heads, head_dim) and both caches "
            f"(num_blocks, block_size, num_kv_heads, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    for name in ("q", "k_cache", "v_cache"):
        if not tensors[name].is_contiguous():
            raise ValueError(f"paged_decode_attention_cpu: {name} must be contiguous")
    nd, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % kv_heads or num_heads // kv_heads > _MAX_GROUP:
        raise ValueError(
            f"paged_decode_attention_cpu: {num_heads} query heads of size {head_dim} against a cache "
            f"of {kv_heads} KV heads of size {k_cache.shape[3]} (KV heads must divide query heads, "
            f"at most {_MAX_GROUP} per KV head)"
        )
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("paged_decode_attention_cpu: block_table and seq_lens must be int32")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != nd
        or (block_table.shape[1] > 1 and block_table.stride(1) != 1)
    ):
        raise ValueError(
            f"paged_decode_attention_cpu: block_table must be ({nd}, max_blocks) with contiguous rows; "
            f"got {tuple(block_table.shape)} strides {block_table.stride()}"
        )
    if seq_lens.shape != (nd,) or not seq_lens.is_contiguous():
        raise ValueError(
            f"paged_decode_attention_cpu: seq_lens must be a contiguous ({nd},); got {tuple(seq_lens.shape)}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"paged_decode_attention_cpu: sliding_window must be positive; got {sliding_window}")


# --------------------------------------------------------------------------- task shape

# Decodes per thread timed, and the context each decode attends to (tokens).
TASK_SHAPE_DECODES_PER_THREAD = (1, 2, 4, 8)
TASK_SHAPE_CONTEXT = 512
# All heads per task must be at least this much faster to be taken from a count on.
TASK_SHAPE_MIN_GAIN = 1.05
NEVER = 1 << 20  # an all_heads_from no batch reaches: one KV head per task always


def _time_task_shapes(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, threads: int
) -> dict[int, dict[str, float]]:
    """Median seconds of the kernel on a synthetic cache at each of
    ``TASK_SHAPE_DECODES_PER_THREAD`` × ``threads`` decodes of ``TASK_SHAPE_CONTEXT`` keys,
    one KV head per task (``per_head``) against all of a request's (``all_heads``)."""
    from engine.model.cpu.measured_choice import time_candidates

    blocks_per_req = -(-TASK_SHAPE_CONTEXT // block_size)
    most = max(TASK_SHAPE_DECODES_PER_THREAD) * threads
    cache_shape = (most * blocks_per_req + 1, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape).to(dtype)
    v_cache = torch.randn(cache_shape).to(dtype)
    perm = (
        torch.randperm(most * blocks_per_req, generator=torch.Generator().manual_seed(0)) + 1
    )  # scattered pages
    table = perm.view(most, blocks_per_req).to(torch.int32)
    scale = head_dim**-0.5
    out: dict[int, dict[str, float]] = {}
    for per_thread in TASK_SHAPE_DECODES_PER_THREAD:
        nd = per_thread * threads
        q = torch.randn(nd, num_heads, head_dim).to(dtype)
        lens = torch.full((nd,), TASK_SHAPE_CONTEXT, dtype=torch.int32)
        tbl = table[:nd].contiguous()

        def run(shape: int, q=q, lens=lens, tbl=tbl) -> None:
            paged_decode_attention_cpu(q, k_cache, v_cache, tbl, lens, scale, task_shape=shape)

        out[per_thread] = time_candidates(
            {"per_head": lambda r=run: r(NEVER), "all_heads": lambda r=run: r(1)}, rounds=7
        )
    return out


def choose_task_shape(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    threads: int,
    time_shapes=None,
):
    """From how many decodes per thread the kernel's tasks take all of a request's KV heads
    (contiguous reads of each page) rather than one (more tasks to share out), by timing both
    on this CPU at the model's heads (``measured_choice.py``: cached per CPU, heads, dtype,
    threads).

    Returns:
        A ``Verdict`` whose ``data["all_heads_from"]`` is the smallest timed count from which
        all heads per task is ``TASK_SHAPE_MIN_GAIN``× faster there and at every larger count
        (``NEVER`` where it never is). ``time_shapes``: tests pass a fake ``_time_task_shapes``.
    """
    from engine.model.cpu.measured_choice import Verdict, last_of_winning_run, measured

    if num_kv_heads == 1:
        return Verdict("attention_task_shape", "one KV head: one shape", "the only candidate",
                       data={"all_heads_from": None})  # fmt: skip
    timer = time_shapes or _time_task_shapes

    def measure() -> tuple[str, str, dict]:
        t = timer(num_heads, num_kv_heads, head_dim, dtype, block_size, threads)
        # from the most decodes per thread down, while all heads per task win
        start = last_of_winning_run(sorted(t, reverse=True), t, "all_heads", "per_head", TASK_SHAPE_MIN_GAIN)
        start = NEVER if start is None else start
        detail = "; ".join(
            f"{n * threads} decodes: one KV head per task {1e3 * v['per_head']:.3f} ms, "
            f"all {1e3 * v['all_heads']:.3f} ms"
            for n, v in sorted(t.items())
        )
        choice = (
            "one KV head per task"
            if start == NEVER
            else f"all KV heads per task from {start} decode{'s' if start != 1 else ''} per thread"
        )
        return choice, detail, {"all_heads_from": start}

    key = {"heads": [num_heads, num_kv_heads, head_dim], "dtype": str(dtype), "block_size": block_size,
           "threads": threads, "context": TASK_SHAPE_CONTEXT, "per_thread": TASK_SHAPE_DECODES_PER_THREAD,
           "min_gain": TASK_SHAPE_MIN_GAIN, "kernel": kernel_path().name}  # fmt: skip
    return measured("attention_task_shape", key, measure)
