"""bfloat16 linears through torch's batch-reduce GEMM micro-kernel, one kernel for every row count.

``brgemm_linear(x, packed, out_features, bias)`` is ``F.linear`` for a bfloat16 ``x`` of any
number of rows, through ``csrc/brgemm_linear_cpu.cpp``: the weight is packed once
(``pack_weight``) into the layout of ``at::native::cpublas::brgemm`` (oneDNN's brgemm
micro-kernel, which torch exports and which runs on AMX tiles where the CPU has them), and
each call cuts the rows into blocks of 64 and the output features into blocks of 64, one
micro-kernel call per block pair, float32 sums, one rounding to bfloat16.

Why: oneDNN's matmul primitive, as torch's packed call (``torch.ops.mkldnn._linear_pointwise``)
uses it, is compiled for one exact row count; every new count JIT-compiles a new one (on the
AMX Xeon one layer's four linears took 8-16 ms at a new count against 1.5-2 ms after; the
128-prompt benchmark meets 511 new (count, shape) pairs, 1.34 s of a 17.6 s run). The
micro-kernel is compiled per (rows in a block, block width, K): at most 64 row counts per
weight shape, met in the first steps, then kept. vLLM 0.32's counterpart is its own oneDNN
build's ``onednn_mm``, whose row count is left to run time.

Whether a model's bfloat16 linears use it, and from how many rows, is a measured choice
(``linear.choose_brgemm_linear``, ``--cpu-brgemm-linear``). Built on first use like the other
kernels (``kernel_build.py``, linked against torch's ``libtorch_cpu.so``), cached under
``<GLASSBOX_CACHE_ROOT>/kernels/brgemm_linear_cpu-<hash>.so``, called through ``ctypes`` with
the tensors' data pointers and ``torch.get_num_threads()`` threads (torch's OpenMP pool).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from engine.model.cpu.kernel_build import open_library, torch_link_flags, unbuildable

SOURCE = Path(__file__).resolve().parent / "csrc" / "brgemm_linear_cpu.cpp"

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
        _lib = open_library(SOURCE, "the brgemm linear kernel", {
            "glassbox_brgemm_supported": ([], i32),
            "glassbox_brgemm_block_n": ([], i64),
            "glassbox_brgemm_pack": ([p, p, i64, i64, i32], i32),
            "glassbox_brgemm_linear": ([p, p, p, p, i64, i64, i64, i32], i32),
        }, torch_link_flags())  # fmt: skip
        return _lib


def kernel_unavailable(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve ``dtype`` linears here (only bfloat16; no compiler to build
    it; torch's micro-kernel cannot run bfloat16 on this CPU), or None. Builds the kernel if
    it can."""
    if dtype != torch.bfloat16:
        return f"no kernel for {dtype} (bfloat16 only)"
    if _lib is None and (why := unbuildable(SOURCE, torch_link_flags())):
        return why
    try:
        lib = load_kernel()
    except (RuntimeError, OSError) as e:
        return str(e)
    if not lib.glassbox_brgemm_supported():
        return "torch's brgemm micro-kernel has no bfloat16 code for this CPU"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out_features, in_features), bfloat16, packed for ``brgemm_linear``: a 1-D
    bfloat16 tensor of ``ceil(out/64) * 64 * in`` elements (the micro-kernel's layout, blocks
    of 64 output features).

    Raises:
        ValueError: not a contiguous 2-D bfloat16 CPU tensor, or an odd ``in_features`` (the
            layout pairs inputs).
        RuntimeError: the kernel cannot be built or run here (``kernel_unavailable``).
    """
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight: a 2-D bfloat16 CPU weight; got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")  # fmt: skip
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_weight: in_features must be even; got {k}")
    lib = load_kernel()
    block = lib.glassbox_brgemm_block_n()
    weight = weight.detach().contiguous()
    out = torch.zeros(-(-n // block) * block * k, dtype=torch.bfloat16)
    rc = lib.glassbox_brgemm_pack(weight.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    if rc == -2:
        raise RuntimeError(
            f"torch's brgemm micro-kernel could not pack a ({n}, {k}) bfloat16 weight on this CPU"
        )
    if rc != 0:
        raise RuntimeError(f"glassbox_brgemm_pack returned {rc}")
    return out


def brgemm_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the kernel, ``packed = pack_weight(weight)``.

    Args:
        x: ``(rows, in_features)``, rows >= 1, bfloat16, contiguous, on the CPU.
        packed: ``pack_weight(weight)`` for a weight of ``(out_features, in_features)``.
        out_features: the weight's first dimension.
        bias: ``(out_features,)`` bfloat16, or None.

    Returns ``(rows, out_features)`` bfloat16.

    Raises:
        ValueError: shapes, dtypes, devices or layouts other than above.
    """
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"brgemm_linear: x must be a contiguous 2-D bfloat16 CPU tensor; got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")  # fmt: skip
    rows, k = x.shape
    lib = load_kernel()
    block = lib.glassbox_brgemm_block_n()
    if (
        rows < 1
        or k % 2
        or packed.dtype != torch.bfloat16
        or packed.numel() != -(-out_features // block) * block * k
    ):
        raise ValueError(f"brgemm_linear: packed ({packed.numel()} elements) is not a packed ({out_features}, {k}) "
                         f"weight, or x has {rows} rows")  # fmt: skip
    if bias is not None and (
        bias.dtype != torch.bfloat16 or tuple(bias.shape) != (out_features,) or not bias.is_contiguous()
    ):
        raise ValueError(f"brgemm_linear: bias must be ({out_features},) bfloat16; got {bias.dtype} "
                         f"{tuple(bias.shape)}")  # fmt: skip
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    rc = lib.glassbox_brgemm_linear(
        x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
        rows, out_features, k, torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise RuntimeError(
            f"torch's brgemm micro-kernel failed on {rows} rows of a ({out_features}, {k}) weight"
        )
    if rc != 0:  # the checks above refuse every argument the kernel would refuse: a bug if seen
        raise RuntimeError(f"glassbox_brgemm_linear returned {rc}")
    return y
