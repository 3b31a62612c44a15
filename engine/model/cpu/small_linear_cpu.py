"""Glassbox's own C++ kernel for linears of a few rows (a decode batch of 1 to 4).

``small_linear(x, weight, bias)`` is ``F.linear`` for ``x`` of 1 to ``MAX_ROWS`` rows,
float32 on a CPU with AVX-512 or bfloat16 on one with AVX512-BF16, through
``csrc/small_linear_cpu.cpp``: each thread streams a share of the weight's rows once and
multiplies every row of ``x`` with them, float32 products and sums, a bfloat16 result rounded
to nearest even. At one row a linear is bound by reading its weight: timed alone on the AMX
Xeon (the small benchmark model's linears, weights partly in the cache) this kernel read them
1.3-1.5x faster than oneDNN's packed call; in a worker's step, weights from memory, 1.08-1.16x
in bfloat16 and within 7 % of torch's plain matmul in float32 (2026-12-07, docs/performance.md).

Whether a model's linears use it, and up to how many rows, is a measured choice
(``linear.choose_linear_kernel``, ``--cpu-linear-kernel``). vLLM 0.32 has no counterpart: its
CPU linears go to oneDNN (``onednn_mm``) at every row count.

Built on first use like the paged attention kernel (``kernel_build.py``), cached under
``<GLASSBOX_CACHE_ROOT>/kernels/small_linear_cpu-<hash>.so``, called through ``ctypes``
with the tensors' data pointers and ``torch.get_num_threads()`` threads (torch's OpenMP pool).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from engine.model.cpu.kernel_build import open_library, unbuildable

SOURCE = Path(__file__).resolve().parent / "csrc" / "small_linear_cpu.cpp"
MAX_ROWS = 4  # the kernel's largest row count (its fixed-size register blocks)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def load_kernel() -> ctypes.CDLL:
    """Build the kernel unless it is cached (``kernel_build.kernel_file``), load it, and
    return the library.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (see ``kernel_build.build``).
    """
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        _lib = open_library(SOURCE, "the small-linear kernel", {
            "glassbox_small_linear": ([i32, p, p, p, p, i64, i64, i64, i32], i32),
            "glassbox_small_linear_supports": ([i32], i32),
        })  # fmt: skip
        return _lib


def kernel_unavailable(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve ``dtype`` linears here (no compiler to build it, a dtype it
    has no code for, or a CPU without the instructions: AVX-512 for float32, AVX512-BF16 for
    bfloat16), or None. Builds the kernel if it can."""
    if dtype not in _DTYPE_CODES:
        return f"no kernel for {dtype} (float32 and bfloat16 only)"
    if _lib is None and (why := unbuildable(SOURCE)):
        return why
    try:
        lib = load_kernel()
    except (RuntimeError, OSError) as e:
        return str(e)
    if not lib.glassbox_small_linear_supports(_DTYPE_CODES[dtype]):
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX-512"
        return f"this CPU has no {need} (the kernel's {dtype} code needs it)"
    return None


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the kernel.

    Args:
        x: ``(rows, in_features)``, 1 <= rows <= ``MAX_ROWS``, float32 or bfloat16, contiguous,
            on the CPU.
        weight: ``(out_features, in_features)``, ``x``'s dtype, contiguous.
        bias: ``(out_features,)`` of ``x``'s dtype, or None.

    Returns ``(rows, out_features)`` in ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes, devices or layouts other than above.
        RuntimeError: the kernel cannot be built, or has no code for the dtype on this CPU
            (``kernel_unavailable`` says why beforehand).
    """
    _check(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype)
    rc = load_kernel().glassbox_small_linear(
        _DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
        y.data_ptr(), rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if rc == -3:
        raise RuntimeError(f"small_linear: {kernel_unavailable(x.dtype)}")
    if rc != 0:  # _check refuses every other argument the kernel would refuse: a bug if seen
        raise RuntimeError(f"glassbox_small_linear returned {rc}")
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Refuse what the kernel would read wrongly (it trusts its pointers and sizes)."""
    tensors = {"x": x, "weight": weight} | ({} if bias is None else {"bias": bias})
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != x.dtype:
            raise ValueError(f"small_linear: {name} must be a contiguous CPU tensor of x's dtype ({x.dtype}); "
                             f"got {t.dtype} on {t.device}, contiguous: {t.is_contiguous()}")  # fmt: skip
    if x.dtype not in _DTYPE_CODES:
        raise ValueError(f"small_linear: dtype {x.dtype} is not supported (float32, bfloat16)")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(
            f"small_linear: x must be (rows, in_features) with 1 to {MAX_ROWS} rows; got {tuple(x.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] < 1:
        raise ValueError(
            f"small_linear: weight must be (out_features, {x.shape[1]}); got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"small_linear: bias must be ({weight.shape[0]},); got {tuple(bias.shape)}")
