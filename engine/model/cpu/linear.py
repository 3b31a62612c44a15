"""Linear weights pre-packed for oneDNN on a CPU, and bfloat16 linears run as float32 where
that is faster: ``CPUPackedLinearMethod``, a ``LinearMethodBase`` (``engine/model/layers.py``).

vLLM counterpart: ``UnquantizedLinearMethod.process_weights_after_loading`` →
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``), which packs the
weight for oneDNN once in its CPU build. Here the loader calls ``pack_linear_weights`` after
``load_weights``, and each packed layer's ``linear_method`` becomes ``CPUPackedLinearMethod``:
the blocked layout oneDNN's matmul wants is made once instead of on every call. Measured on
the "small" benchmark model, one thread, per CPU-second: +15–20 % output tokens in float32,
+10 % in bfloat16 (docs/performance.md). The plain ``weight`` stays (the loader, tied
embeddings and the tests read it), so linear weights take twice their size in memory (vLLM
frees it).

bfloat16: oneDNN's bfloat16 matmul is twice as fast as its float32 one on some CPUs (AMD
Zen 4's AVX512-BF16, Intel's AMX) and half as fast on others (an Intel Xeon with AVX512-BF16
but no AMX). The same math (bfloat16 operands, float32 products and sums, one rounding) runs
either way, so ``choose_bf16_linear`` times both at the model's shapes on this CPU
(``measured_choice.py``: once, cached) and, where the float32 path wins, each linear weight is
also kept upcast and packed (``packed_weight_f32``) for steps from the measured row count on —
four times the bfloat16 weight's size, so not where those copies would take more than a
quarter of the memory available (``F32_COPIES_MAX_SHARE``). ``--cpu-bf16-linear
native|upcast`` forces either side.

float32 at a few rows: a decode batch of one or two multiplies each weight by a vector or
two, where torch's plain matmul (``F.linear`` on the unpacked weight) can beat oneDNN's packed
call (on the AMX Xeon the small model's 33 linears at one row: 5.2 against 6.8 ms; from four
rows the packed call wins). ``choose_f32_linear`` times a pass over the model's linears both
ways at ``F32_TIMING_ROWS`` and steps up to the measured row count run the plain one (the
weight is kept anyway: no memory); ``--cpu-f32-linear packed|plain`` forces either side.

Glassbox's own kernel at one to four rows (``small_linear_cpu.py``): a matrix-vector product
that streams each weight once. ``choose_linear_kernel`` times a pass over the model's linears
through it against the path chosen above, at ``KERNEL_TIMING_ROWS``, and steps up to the
measured row count use it (on the AMX Xeon, the small model's bfloat16 linears at one row:
3.4-3.6 against 3.7-4.2 ms); ``--cpu-linear-kernel on|off`` forces it.

bfloat16 at more rows, through torch's brgemm micro-kernel (``brgemm_linear_cpu.py``): oneDNN's
matmul primitive, as torch's packed call uses it, is compiled anew for every new row count (8-16
ms for a layer's four linears on the AMX Xeon); the micro-kernel at most once per row count
under 64 and weight shape. ``choose_brgemm_linear`` times a pass over the model's bfloat16
linears through it against the library path at ``BRGEMM_TIMING_ROWS`` and steps up to the
measured row count use it; ``--cpu-brgemm-linear auto|on|off``.

Under ``torch.compile`` a packed linear is one opaque op, ``glassbox::onednn_linear``:
Inductor's own oneDNN lowering wants the weights frozen into the graph, which would rule out
the on-disk compile cache (``compile.py``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import (
    CPU_BF16_MODES,
    CPU_BRGEMM_LINEAR_MODES,
    CPU_F32_LINEAR_MODES,
    CPU_LINEAR_KERNEL_MODES,
)
from engine.logger import init_logger
from engine.model.cpu import brgemm_linear_cpu, small_linear_cpu
from engine.model.cpu.measured_choice import Verdict, last_of_winning_run, measured, time_candidates
from engine.model.cpu.op_threads import get_op_threads, op_threads
from engine.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    VocabParallelEmbedding,
)

logger = init_logger(__name__)

# Rows of input from which this process's bfloat16 linears run as float32 matmuls (None: never):
# the verdict of ``choose_bf16_linear``, set by ``pack_linear_weights``. Read per call by
# ``_onednn_linear`` (inside the compiled graph too: the packed op is opaque to Inductor).
_bf16_as_f32_min_rows: int | None = None

# Rows of input up to which this process's float32 linears run through torch's plain matmul
# (None: never): the verdict of ``choose_f32_linear``, set by ``pack_linear_weights``.
_f32_plain_max_rows: int | None = None

# Rows of input up to which this process's linears of each dtype run through Glassbox's own
# kernel (``small_linear_cpu.py``; a dtype absent: never): the verdict of
# ``choose_linear_kernel``, set by ``pack_linear_weights``.
_kernel_max_rows: dict[torch.dtype, int] = {}

# Rows of input up to which this process's bfloat16 linears run through torch's brgemm
# micro-kernel (``brgemm_linear_cpu.py``; None: never): the verdict of ``choose_brgemm_linear``,
# set by ``pack_linear_weights``. Fewer rows than ``_kernel_max_rows`` allows go to our kernel.
_brgemm_max_rows: int | None = None

# The row counts the brgemm micro-kernel is timed at against the library path (decode
# batches; a prefill chunk of hundreds of rows is oneDNN's: its primitive, once compiled for
# that count, was 1.25x faster at 2,048 rows on the AMX Xeon).
BRGEMM_TIMING_ROWS = (8, 16, 32, 64, 128)
# The micro-kernel must be at least this fast in the steady state to be chosen: at a tie it
# still wins in a run, where oneDNN compiles a primitive for each new row count and it does not.
BRGEMM_MIN_GAIN = 1.0

# The row counts the kernel is timed at against the library path (decode batches of 1 to 4).
KERNEL_TIMING_ROWS = (1, 2, 4)
# The kernel must be at least this much faster to be chosen (a tie keeps the library).
KERNEL_MIN_GAIN = 1.1

# The row counts a float32 linear is timed at for the plain matmul (small decode batches).
F32_TIMING_ROWS = (1, 2, 4)
# The plain matmul must be at least this much faster to be chosen (a tie keeps the packed one).
F32_PLAIN_MIN_GAIN = 1.1
# --cpu-f32-linear plain: every row count.
_EVERY_ROW_COUNT = 2**31

# The row counts a bfloat16 linear is timed at (decode batches to a prefill chunk's size).
BF16_TIMING_ROWS = (16, 64, 256)
# The float32 path must be at least this much faster to be chosen: it takes twice the weight
# memory, so a tie (or noise) keeps the bfloat16 kernel.
BF16_UPCAST_MIN_GAIN = 1.1


class CPUPackedLinearMethod(UnquantizedLinearMethod):
    """``x W^T + b`` through oneDNN's matmul with the weight pre-packed (``packed_weight``);
    ``F.linear`` where there is no packed weight, the input is not 2-D, or autograd is on
    (the packed op has no backward).

    Args:
        upcast_bf16: also pack a bfloat16 weight upcast to float32 (``packed_weight_f32``),
            which inputs of at least the measured row count use: see
            ``pack_linear_weights``.
    """

    def __init__(self, upcast_bf16: bool = False) -> None:
        self.upcast_bf16 = upcast_bf16

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Set ``layer.packed_weight`` (None where oneDNN cannot take the weight) and
        ``layer.packed_weight_f32``."""
        layer.packed_weight = _pack_for_onednn(layer.weight)
        layer.packed_weight_f32 = None
        if layer.packed_weight is not None and layer.weight.dtype == torch.bfloat16 and self.upcast_bf16:
            layer.packed_weight_f32 = _pack_for_onednn(layer.weight.detach().float())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if packed is None or x.dim() != 2 or torch.is_grad_enabled():
            return F.linear(x, layer.weight, bias)
        brgemm = getattr(layer, "packed_weight_brgemm", None)
        if torch.compiler.is_compiling():
            return torch.ops.glassbox.onednn_linear(
                x, layer.weight, bias, packed, layer.packed_weight_f32, brgemm
            )
        return _onednn_linear(x, layer.weight, bias, packed, layer.packed_weight_f32, brgemm)


def _onednn_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    packed_f32: torch.Tensor | None,
    packed_brgemm: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 0:
        return F.linear(x, weight, bias)
    with op_threads():  # the worker's thread count of the moment (engine/model/cpu/op_threads.py)
        if rows <= _kernel_max_rows.get(x.dtype, 0) and x.is_contiguous() and weight.is_contiguous():
            return small_linear_cpu.small_linear(x, weight, bias)  # a few rows: our kernel measured faster
        if _f32_plain_max_rows is not None and rows <= _f32_plain_max_rows and x.dtype == torch.float32:
            return F.linear(x, weight, bias)  # a few rows: torch's plain matmul measured faster
        if (packed_brgemm is not None and _brgemm_max_rows is not None and rows <= _brgemm_max_rows
                and x.dtype == torch.bfloat16 and x.is_contiguous()
                and (bias is None or bias.dtype == torch.bfloat16)):  # fmt: skip
            # one micro-kernel for every row count: measured faster (and no compile per new count)
            return brgemm_linear_cpu.brgemm_linear(x, packed_brgemm, weight.shape[0], bias)
        if packed_f32 is not None and _bf16_as_f32_min_rows is not None and rows >= _bf16_as_f32_min_rows:
            # Exactly the bfloat16 matmul's math (bfloat16 operands, float32 products and sums,
            # one rounding of the result), on the CPU's faster float32 units.
            bias_f32 = None if bias is None else bias.float()
            y = torch.ops.mkldnn._linear_pointwise(x.float(), packed_f32, bias_f32, "none", [], "")
            return y.to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("glassbox::onednn_linear", mutates_args=())
def onednn_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    packed_f32: torch.Tensor | None,
    packed_brgemm: torch.Tensor | None,
) -> torch.Tensor:
    """``CPUPackedLinearMethod.apply`` as one op of a compiled graph: Inductor calls it as
    it is (its own lowering of oneDNN's op wants the weights frozen into the graph), and the
    choice between the kernels and ``packed``, ``packed_f32`` and ``packed_brgemm`` is made
    per call, on the step's row count."""
    return _onednn_linear(x, weight, bias, packed, packed_f32, packed_brgemm)


@onednn_linear.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    packed_f32: torch.Tensor | None,
    packed_brgemm: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (out, in) reordered for oneDNN's matmul, or None where that does not apply
    (not on a CPU, not float32/bfloat16, no oneDNN, or a bfloat16 the CPU cannot run)."""
    if not _pack_for_onednn_possible(weight):
        return None
    try:
        # The layout is tuned for 32 rows of input (a decode batch); any row count works.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
    except RuntimeError:
        return None


# The float32 copies of bfloat16 weights are made only if they take at most this share of
# the memory available when the model has loaded (the KV cache is allocated after).
F32_COPIES_MAX_SHARE = 0.25


def _f32_copies_fit(num_bytes: int) -> bool:
    import psutil

    available = psutil.virtual_memory().available
    if num_bytes <= F32_COPIES_MAX_SHARE * available:
        return True
    logger.info(
        "bfloat16 linears stay bfloat16, though float32 measured faster: their float32 copies "
        "(%.1f GiB) would take more than a quarter of the %.1f GiB available",
        num_bytes / 2**30,
        available / 2**30,
    )
    return False


def _time_bf16_linear(weight: torch.Tensor, rows: int, timer: Callable[[], float]) -> dict[str, float]:
    """Median seconds of one ``rows``-row linear with ``weight`` (bfloat16, (out, in)): oneDNN's
    bfloat16 kernel (``native``) against the same math as a float32 matmul of the upcast
    weight, casts included (``upcast``)."""
    packed = _pack_for_onednn(weight)
    packed_f32 = _pack_for_onednn(weight.detach().float())
    x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)

    def native() -> None:
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def upcast() -> None:
        torch.ops.mkldnn._linear_pointwise(x.float(), packed_f32, None, "none", [], "").to(torch.bfloat16)

    with torch.inference_mode(), op_threads():
        return time_candidates({"native": native, "upcast": upcast}, rounds=5, timer=timer)


def choose_bf16_linear(
    weights: list[torch.Tensor],
    mode: str = "auto",
    time_linear: Callable[[torch.Tensor, int], dict[str, float]] | None = None,
) -> Verdict:
    """Whether this model's bfloat16 linears run natively (oneDNN's bfloat16 kernel) or as
    float32 matmuls of upcast weights, and from how many rows: by measurement on this CPU.

    Args:
        weights: the bfloat16 linear weights of the model, (out, in) each; one of each
            distinct shape is timed and weighted by how many the model has.
        mode: ``--cpu-bf16-linear``: ``auto`` (measure, or read an earlier start's verdict),
            ``native`` or ``upcast`` (forced; upcast then from one row).
        time_linear: ``(weight, rows) -> {"native": s, "upcast": s}``; tests pass a fake.

    Returns:
        A ``Verdict`` whose ``data["min_rows"]`` is the smallest of ``BF16_TIMING_ROWS`` from
        which the upcast path is at least ``BF16_UPCAST_MIN_GAIN``× faster for the whole
        model's linears at that row count and every larger one, or None (native always).
    """
    if mode not in CPU_BF16_MODES:
        raise ValueError(f"--cpu-bf16-linear {mode!r}: allowed: {', '.join(CPU_BF16_MODES)}")
    if mode == "native":
        return Verdict("bf16_linear", "native", "forced by --cpu-bf16-linear", data={"min_rows": None})
    if mode == "upcast":
        return Verdict("bf16_linear", "upcast", "forced by --cpu-bf16-linear", data={"min_rows": 1})
    counts: dict[tuple[int, int], int] = {}
    examples: dict[tuple[int, int], torch.Tensor] = {}
    for w in weights:
        shape = (int(w.shape[0]), int(w.shape[1]))
        counts[shape] = counts.get(shape, 0) + 1
        examples.setdefault(shape, w)
    timer = time.perf_counter
    time_one = time_linear or (lambda w, rows: _time_bf16_linear(w, rows, timer))

    def measure() -> tuple[str, str, dict]:
        totals = {}
        for rows in BF16_TIMING_ROWS:
            per = {"native": 0.0, "upcast": 0.0}
            for shape, w in examples.items():
                t = time_one(w, rows)
                per["native"] += counts[shape] * t["native"]
                per["upcast"] += counts[shape] * t["upcast"]
            totals[rows] = per
        # from the largest row count down, while upcast wins
        min_rows = last_of_winning_run(
            reversed(BF16_TIMING_ROWS), totals, "upcast", "native", BF16_UPCAST_MIN_GAIN
        )
        detail = "; ".join(
            f"{rows} rows: native {1e3 * t['native']:.2f} ms, upcast {1e3 * t['upcast']:.2f} ms"
            for rows, t in totals.items()
        )
        choice = "native" if min_rows is None else f"upcast from {min_rows} rows"
        return choice, f"the model's linears, {detail}", {"min_rows": min_rows}

    key = {"shapes": sorted(counts.items()), "threads": get_op_threads(), "rows": BF16_TIMING_ROWS,
           "min_gain": BF16_UPCAST_MIN_GAIN}  # fmt: skip
    return measured("bf16_linear", key, measure)


def _time_f32_linears(
    layers: list[tuple[torch.Tensor, torch.Tensor]], rows: int, timer: Callable[[], float]
) -> dict[str, float]:
    """Median seconds of one pass over the model's float32 linears (``(weight, packed)`` each,
    in model order) at ``rows`` rows of input: oneDNN's packed call (``packed``) against
    torch's plain matmul on the weight as it is (``plain``). The whole model, not one weight
    of each shape: a weight timed alone stays in the cache between calls, which flattered the
    plain matmul at four rows (faster alone, 7 % slower in a real step)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.float32) for w, _ in layers}

    def packed_pass() -> None:
        for w, packed in layers:
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed, None, "none", [], "")

    def plain_pass() -> None:
        for w, _ in layers:
            F.linear(inputs[w.shape[1]], w)

    with torch.inference_mode(), op_threads():
        return time_candidates({"packed": packed_pass, "plain": plain_pass}, rounds=5, timer=timer)


def choose_f32_linear(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    mode: str = "auto",
    time_linears: Callable[[list[tuple[torch.Tensor, torch.Tensor]], int], dict[str, float]] | None = None,
) -> Verdict:
    """Up to how many rows this model's float32 linears run through torch's plain matmul
    rather than oneDNN's packed one: by measurement on this CPU.

    Args:
        layers: the model's float32 linears as ``(weight (out, in), packed weight)``, in model
            order; a pass over all of them is timed at each of ``F32_TIMING_ROWS``.
        mode: ``--cpu-f32-linear``: ``auto`` (measure, or read an earlier start's verdict),
            ``packed`` or ``plain`` (forced, at every row count).
        time_linears: ``(layers, rows) -> {"packed": s, "plain": s}``; tests pass a fake.

    Returns:
        A ``Verdict`` whose ``data["max_rows"]`` is the largest of ``F32_TIMING_ROWS`` up to
        which the plain matmul is at least ``F32_PLAIN_MIN_GAIN``× faster at that row count
        and every smaller one, or None (packed always).

    Raises:
        ValueError: ``mode`` is not one of ``CPU_F32_LINEAR_MODES``.
    """
    if mode not in CPU_F32_LINEAR_MODES:
        raise ValueError(f"--cpu-f32-linear {mode!r}: allowed: {', '.join(CPU_F32_LINEAR_MODES)}")
    if mode == "packed":
        return Verdict("f32_linear", "packed", "forced by --cpu-f32-linear", data={"max_rows": None})
    if mode == "plain":
        return Verdict(
            "f32_linear", "plain", "forced by --cpu-f32-linear", data={"max_rows": _EVERY_ROW_COUNT}
        )
    timer = time.perf_counter
    time_pass = time_linears or (lambda layers, rows: _time_f32_linears(layers, rows, timer))

    def measure() -> tuple[str, str, dict]:
        max_rows, detail = _winning_rows(
            time_pass, layers, F32_TIMING_ROWS, "plain", "packed", F32_PLAIN_MIN_GAIN
        )
        choice = "packed" if max_rows is None else f"plain up to {_rows(max_rows)}"
        return choice, detail, {"max_rows": max_rows}

    key = {"shapes": _shape_counts(w for w, _ in layers), "threads": get_op_threads(), "rows": F32_TIMING_ROWS,
           "min_gain": F32_PLAIN_MIN_GAIN, "timed": "a pass over every layer"}  # fmt: skip
    return measured("f32_linear", key, measure)


def _winning_rows(
    time_pass: Callable[[list, int], dict[str, float]],
    layers: list,
    timing_rows: tuple[int, ...],
    candidate: str,
    baseline: str,
    min_gain: float,
) -> tuple[int | None, str]:
    """Time a pass over ``layers`` at each of ``timing_rows`` (``time_pass(layers, rows)`` ->
    seconds per side) and return the largest row count up to which ``candidate`` beats
    ``baseline`` by ``min_gain`` at that count and every smaller one (None: not even at the
    first), with the timings in words for the verdict."""
    totals = {rows: time_pass(layers, rows) for rows in timing_rows}
    max_rows = last_of_winning_run(timing_rows, totals, candidate, baseline, min_gain)  # from one row up
    detail = "; ".join(
        f"{rows} rows: {baseline} {1e3 * t[baseline]:.2f} ms, {candidate} {1e3 * t[candidate]:.2f} ms"
        for rows, t in totals.items()
    )
    return max_rows, f"the model's linears, {detail}"


def _shape_counts(weights) -> list[tuple[tuple[int, int], int]]:
    """``[((out, in), how many weights of that shape), ...]``, sorted: a verdict's cache key."""
    counts: dict[tuple[int, int], int] = {}
    for w in weights:
        shape = (int(w.shape[0]), int(w.shape[1]))
        counts[shape] = counts.get(shape, 0) + 1
    return sorted(counts.items())


def _rows(n: int) -> str:
    """``"1 row"``, ``"4 rows"``."""
    return f"{n} row" if n == 1 else f"{n} rows"


def _time_kernel_linears(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    rows: int,
    timer: Callable[[], float],
) -> dict[str, float]:
    """Median seconds of one pass over the model's linears (``(weight, packed, packed_f32)``
    each, in model order) at ``rows`` rows of input: the library path this process's other
    verdicts chose (``library``: ``_onednn_linear`` as a step calls it) against Glassbox's
    kernel (``kernel``)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w, _, _ in layers}

    def library_pass() -> None:
        for w, packed, packed_f32 in layers:
            _onednn_linear(inputs[w.shape[1]], w, None, packed, packed_f32)

    def kernel_pass() -> None:
        for w, _, _ in layers:
            small_linear_cpu.small_linear(inputs[w.shape[1]], w)

    with torch.inference_mode(), op_threads():
        return time_candidates({"library": library_pass, "kernel": kernel_pass}, rounds=5, timer=timer)


def choose_linear_kernel(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    mode: str = "auto",
    time_linears: Callable[[list, int], dict[str, float]] | None = None,
    unavailable: Callable[[torch.dtype], str | None] = small_linear_cpu.kernel_unavailable,
) -> Verdict:
    """Up to how many rows (at most ``small_linear_cpu.MAX_ROWS``) this model's linears run
    through Glassbox's own kernel rather than the library path: by measurement on this CPU.

    Args:
        layers: the model's packed linears of one dtype as ``(weight (out, in), packed weight,
            packed float32 copy or None)``, in model order; a pass over all of them is timed
            at each of ``KERNEL_TIMING_ROWS``, against the path the other verdicts chose.
        mode: ``--cpu-linear-kernel``: ``auto`` (measure, or read an earlier start's verdict),
            ``on`` (up to ``MAX_ROWS`` rows) or ``off``.
        time_linears: ``(layers, rows) -> {"library": s, "kernel": s}``; tests pass a fake.
        unavailable: why the kernel cannot run the dtype here, or None
            (``small_linear_cpu.kernel_unavailable``); tests pass their own.

    Returns:
        A ``Verdict`` whose ``data["max_rows"]`` is the largest of ``KERNEL_TIMING_ROWS`` up
        to which the kernel is at least ``KERNEL_MIN_GAIN``× faster at that row count and
        every smaller one, or None (the library always; also where the kernel cannot run:
        no compiler, or a CPU without AVX-512 / AVX512-BF16, said in the verdict).

    Raises:
        ValueError: ``mode`` is not one of ``CPU_LINEAR_KERNEL_MODES``.
    """
    if mode not in CPU_LINEAR_KERNEL_MODES:
        raise ValueError(f"--cpu-linear-kernel {mode!r}: allowed: {', '.join(CPU_LINEAR_KERNEL_MODES)}")
    if mode == "off":
        return Verdict("linear_kernel", "off", "forced by --cpu-linear-kernel", data={"max_rows": None})
    why = unavailable(layers[0][0].dtype)
    if why:
        return Verdict("linear_kernel", "off", f"unavailable: {why}", data={"max_rows": None})
    if mode == "on":
        max_rows = small_linear_cpu.MAX_ROWS
        return Verdict("linear_kernel", f"up to {_rows(max_rows)}", "forced by --cpu-linear-kernel",
                       data={"max_rows": max_rows})  # fmt: skip
    timer = time.perf_counter
    time_pass = time_linears or (lambda layers, rows: _time_kernel_linears(layers, rows, timer))

    def measure() -> tuple[str, str, dict]:
        max_rows, detail = _winning_rows(
            time_pass, layers, KERNEL_TIMING_ROWS, "kernel", "library", KERNEL_MIN_GAIN
        )
        choice = "off" if max_rows is None else f"up to {_rows(max_rows)}"
        return choice, detail, {"max_rows": max_rows}

    key = {"shapes": _shape_counts(w for w, _, _ in layers), "dtype": str(layers[0][0].dtype), "threads": get_op_threads(),
           "rows": KERNEL_TIMING_ROWS, "min_gain": KERNEL_MIN_GAIN,
           "library": [_f32_plain_max_rows, _bf16_as_f32_min_rows],  # what the kernel is timed against
           "kernel": _kernel_source_digest()}  # fmt: skip
    return measured("linear_kernel", key, measure)


def _kernel_source_digest() -> str:
    """A digest of the kernel's source: an edited kernel is measured again."""
    return hashlib.sha256(small_linear_cpu.SOURCE.read_bytes()).hexdigest()[:16]


def _time_brgemm_linears(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]],
    rows: int,
    timer: Callable[[], float],
) -> dict[str, float]:
    """Median seconds of one pass over the model's bfloat16 linears (``(weight, packed,
    packed_f32, packed_brgemm)`` each, in model order) at ``rows`` rows: the library path the
    other verdicts chose (``library``) against torch's brgemm micro-kernel (``brgemm``). The
    first, untimed round compiles each side's kernels for the count: the steady state."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w, _, _, _ in layers}

    def library_pass() -> None:
        for w, packed, packed_f32, _ in layers:
            _onednn_linear(inputs[w.shape[1]], w, None, packed, packed_f32)

    def brgemm_pass() -> None:
        for w, _, _, packed_brgemm in layers:
            brgemm_linear_cpu.brgemm_linear(inputs[w.shape[1]], packed_brgemm, w.shape[0])

    with torch.inference_mode(), op_threads():
        return time_candidates({"library": library_pass, "brgemm": brgemm_pass}, rounds=5, timer=timer)


def choose_brgemm_linear(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    mode: str = "auto",
    time_linears: Callable[[list, int], dict[str, float]] | None = None,
    unavailable: Callable[[torch.dtype], str | None] = brgemm_linear_cpu.kernel_unavailable,
) -> Verdict:
    """Up to how many rows this model's bfloat16 linears run through torch's brgemm
    micro-kernel (``brgemm_linear_cpu.py``) rather than the library path: by measurement.

    Args:
        layers: the model's packed bfloat16 linears as ``(weight (out, in), packed weight,
            packed float32 copy or None)``, in model order; they are packed for the
            micro-kernel (only when measuring) and a pass over all of them is timed at each of
            ``BRGEMM_TIMING_ROWS``, against the path the other verdicts chose.
        mode: ``--cpu-brgemm-linear``: ``auto`` (measure, or read an earlier start's verdict),
            ``on`` (every row count) or ``off``.
        time_linears: ``(layers with their brgemm packs, rows) -> {"library": s, "brgemm":
            s}``; tests pass a fake.
        unavailable: why the micro-kernel cannot run bfloat16 here, or None
            (``brgemm_linear_cpu.kernel_unavailable``); tests pass their own.

    Returns:
        A ``Verdict`` whose ``data["max_rows"]`` is the largest of ``BRGEMM_TIMING_ROWS`` up to
        which the micro-kernel is at least ``BRGEMM_MIN_GAIN``× as fast at that row count and
        every smaller one, or None (the library always; also where it cannot run here, or a
        weight has an odd number of inputs, said in the verdict).

    Raises:
        ValueError: ``mode`` is not one of ``CPU_BRGEMM_LINEAR_MODES``.
    """
    if mode not in CPU_BRGEMM_LINEAR_MODES:
        raise ValueError(f"--cpu-brgemm-linear {mode!r}: allowed: {', '.join(CPU_BRGEMM_LINEAR_MODES)}")
    if mode == "off":
        return Verdict("brgemm_linear", "off", "forced by --cpu-brgemm-linear", data={"max_rows": None})
    why = unavailable(torch.bfloat16)
    odd = next((tuple(w.shape) for w, _, _ in layers if w.shape[1] % 2), None)
    if why or odd:
        why = why or f"a weight of shape {odd} has an odd number of inputs"
        return Verdict("brgemm_linear", "off", f"unavailable: {why}", data={"max_rows": None})
    if mode == "on":
        return Verdict("brgemm_linear", "every row count", "forced by --cpu-brgemm-linear",
                       data={"max_rows": _EVERY_ROW_COUNT})  # fmt: skip
    timer = time.perf_counter
    time_pass = time_linears or (lambda layers, rows: _time_brgemm_linears(layers, rows, timer))

    def measure() -> tuple[str, str, dict]:
        with_packs = [(w, p, f, brgemm_linear_cpu.pack_weight(w)) for w, p, f in layers]
        max_rows, detail = _winning_rows(
            time_pass, with_packs, BRGEMM_TIMING_ROWS, "brgemm", "library", BRGEMM_MIN_GAIN
        )
        choice = "off" if max_rows is None else f"up to {_rows(max_rows)}"
        return choice, detail, {"max_rows": max_rows}

    key = {"shapes": _shape_counts(w for w, _, _ in layers), "threads": get_op_threads(),
           "rows": BRGEMM_TIMING_ROWS, "min_gain": BRGEMM_MIN_GAIN,
           "library": [_bf16_as_f32_min_rows],  # what the micro-kernel is timed against
           "kernel": hashlib.sha256(brgemm_linear_cpu.SOURCE.read_bytes()).hexdigest()[:16]}  # fmt: skip
    return measured("brgemm_linear", key, measure)


def pack_linear_weights(model: nn.Module, bf16_linear: str = "auto", f32_linear: str = "auto",
                        linear_kernel: str = "auto", brgemm_linear: str = "auto") -> int:  # fmt: skip
    """Put ``CPUPackedLinearMethod`` on every linear of ``model`` (and its ``lm_head``) whose
    weight oneDNN can take, and pack it; returns how many were packed (0 off the CPU). Call
    once, after ``load_weights`` (vLLM: ``process_weights_after_loading``).

    For bfloat16 weights, ``choose_bf16_linear`` decides (by measurement on this CPU, or
    ``bf16_linear``: ``--cpu-bf16-linear``) whether steps from some row count on run as
    float32 matmuls of upcast weights (``packed_weight_f32``, twice the bytes) — unless those
    copies would take more than ``F32_COPIES_MAX_SHARE`` of the memory available now (a big
    model on a small machine): then the bfloat16 kernel serves every step, and a log line
    says so. For float32 weights, ``choose_f32_linear`` decides (``f32_linear``:
    ``--cpu-f32-linear``) up to how many rows torch's plain matmul serves instead. Then, for
    each dtype, ``choose_linear_kernel`` decides (``linear_kernel``: ``--cpu-linear-kernel``)
    up to how many rows Glassbox's own kernel serves instead of all that, and for bfloat16,
    ``choose_brgemm_linear`` (``brgemm_linear``: ``--cpu-brgemm-linear``) up to how many rows
    torch's brgemm micro-kernel does (each such weight then also packed for it,
    ``packed_weight_brgemm``: its size once more). The verdicts are kept as
    ``model.measured_choices`` (the worker's status shows them)."""
    global _bf16_as_f32_min_rows, _f32_plain_max_rows, _brgemm_max_rows
    targets = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):  # ParallelLMHead, or the tied embedding table
        targets.append(head)
    targets = [m for m in targets if _pack_for_onednn_possible(m.weight)]
    bf16 = [m.weight for m in targets if m.weight.dtype == torch.bfloat16]
    as_f32 = False
    if bf16:
        verdict = choose_bf16_linear(bf16, bf16_linear)
        logger.info("%s", verdict.text())
        min_rows = verdict.data.get("min_rows")
        as_f32 = min_rows is not None and _f32_copies_fit(sum(4 * w.numel() for w in bf16))
        if min_rows is not None and not as_f32:
            verdict = Verdict(verdict.name, "native", f"{verdict.source}, no memory for float32 copies",
                              verdict.detail, {"min_rows": None})  # fmt: skip
        _bf16_as_f32_min_rows = min_rows if as_f32 else None
        model.measured_choices = [verdict]
    method = CPUPackedLinearMethod(upcast_bf16=as_f32)
    packed = 0
    for module in targets:
        method.process_weights_after_loading(module)
        if module.packed_weight is not None:
            module.linear_method = method
            packed += 1
    f32 = [
        (m.weight, m.packed_weight)
        for m in targets
        if m.weight.dtype == torch.float32 and m.packed_weight is not None
    ]
    _f32_plain_max_rows = None
    if f32:
        verdict = choose_f32_linear(f32, f32_linear)
        logger.info("%s", verdict.text())
        _f32_plain_max_rows = verdict.data.get("max_rows")
        model.measured_choices = [*getattr(model, "measured_choices", []), verdict]
    _kernel_max_rows.clear()
    packed_layers = [(m.weight, m.packed_weight, m.packed_weight_f32) for m in targets
                     if m.packed_weight is not None and m.weight.is_contiguous()]  # fmt: skip
    for dtype in dict.fromkeys(w.dtype for w, _, _ in packed_layers):
        verdict = choose_linear_kernel(
            [layer for layer in packed_layers if layer[0].dtype == dtype], linear_kernel
        )
        logger.info("%s", verdict.text())
        if verdict.data.get("max_rows") is not None:
            _kernel_max_rows[dtype] = verdict.data["max_rows"]
        model.measured_choices = [*getattr(model, "measured_choices", []), verdict]
    _brgemm_max_rows = None
    bf16_packed = [m for m in targets if m.packed_weight is not None and m.weight.dtype == torch.bfloat16]
    if bf16_packed:
        verdict = choose_brgemm_linear(
            [(m.weight, m.packed_weight, m.packed_weight_f32) for m in bf16_packed], brgemm_linear
        )
        logger.info("%s", verdict.text())
        _brgemm_max_rows = verdict.data.get("max_rows")
        if _brgemm_max_rows is not None:
            for m in bf16_packed:
                m.packed_weight_brgemm = brgemm_linear_cpu.pack_weight(m.weight)
        model.measured_choices = [*getattr(model, "measured_choices", []), verdict]
    return packed


def _pack_for_onednn_possible(weight: torch.Tensor) -> bool:
    """Whether ``_pack_for_onednn`` can take ``weight`` (device, dtype, oneDNN), without packing."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32
