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
frees it). A bfloat16 model on a CPU without AMX also keeps each linear weight upcast to
float32 and packed (``bf16_linears_as_f32``: the same math, faster there for steps of
``BF16_AS_F32_MIN_ROWS`` rows or more), so its linear weights take four times their bfloat16
size — unless those copies would take more than a quarter of the memory available
(``F32_COPIES_MAX_SHARE``): then they are not made.

Under ``torch.compile`` a packed linear is one opaque op, ``glassbox::onednn_linear``:
Inductor's own oneDNN lowering wants the weights frozen into the graph, which would rule out
the on-disk compile cache (``compile.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.logger import init_logger
from engine.model.cpu.op_threads import op_threads
from engine.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    VocabParallelEmbedding,
)

logger = init_logger(__name__)

# Rows of input from which a bfloat16 linear runs as a float32 matmul, on a CPU without AMX:
# measured in the small benchmark model's compiled step (2-core Xeon), 64 rows and up gain
# (decode of 64: -7 %, of 128: -15 %, a 16 × 128-token prefill: -30 % step time); below,
# the casts cost what the matmul saves, and under 16 rows reading half the bytes wins.
BF16_AS_F32_MIN_ROWS = 64


class CPUPackedLinearMethod(UnquantizedLinearMethod):
    """``x W^T + b`` through oneDNN's matmul with the weight pre-packed (``packed_weight``);
    ``F.linear`` where there is no packed weight, the input is not 2-D, or autograd is on
    (the packed op has no backward).

    Args:
        upcast_bf16: also pack a bfloat16 weight upcast to float32 (``packed_weight_f32``),
            which inputs of at least ``BF16_AS_F32_MIN_ROWS`` rows use: see
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
        if torch.compiler.is_compiling():
            return torch.ops.glassbox.onednn_linear(x, layer.weight, bias, packed, layer.packed_weight_f32)
        return _onednn_linear(x, layer.weight, bias, packed, layer.packed_weight_f32)


def _onednn_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    packed_f32: torch.Tensor | None,
) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 0:
        return F.linear(x, weight, bias)
    with op_threads():  # the worker's thread count of the moment (engine/model/cpu/op_threads.py)
        if packed_f32 is not None and rows >= BF16_AS_F32_MIN_ROWS:
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
) -> torch.Tensor:
    """``CPUPackedLinearMethod.apply`` as one op of a compiled graph: Inductor calls it as
    it is (its own lowering of oneDNN's op wants the weights frozen into the graph), and the
    choice between ``packed`` and ``packed_f32`` is made per call, on the step's row count."""
    return _onednn_linear(x, weight, bias, packed, packed_f32)


@onednn_linear.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    packed_f32: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (out, in) reordered for oneDNN's matmul, or None where that does not apply
    (not on a CPU, not float32/bfloat16, no oneDNN, or a bfloat16 the CPU cannot run)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        # The layout is tuned for 32 rows of input (a decode batch); any row count works.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
    except RuntimeError:
        return None


def bf16_linears_as_f32() -> bool:
    """Whether bfloat16 linears of ``BF16_AS_F32_MIN_ROWS`` rows or more run as float32
    matmuls on this CPU: where it has no AMX tiles. Its bfloat16 dot products (AVX512-BF16)
    then do no more per cycle than its float32 FMAs, and oneDNN's bfloat16 kernel reached
    166 GFLOP/s against 258–304 in float32 on a 2-core Xeon, so the same math is faster in
    float32 (1.3–1.55× per linear from 64 rows up, casts included)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return is_amx is not None and not is_amx()


# The float32 copies of bfloat16 weights are made only if they take at most this share of
# the memory available when the model has loaded (the KV cache is allocated after).
F32_COPIES_MAX_SHARE = 0.25


def _f32_copies_fit(num_bytes: int) -> bool:
    import psutil

    available = psutil.virtual_memory().available
    if num_bytes <= F32_COPIES_MAX_SHARE * available:
        return True
    logger.info(
        "bfloat16 linears stay bfloat16 on this CPU without AMX: their float32 copies "
        "(%.1f GiB) would take more than a quarter of the %.1f GiB available",
        num_bytes / 2**30,
        available / 2**30,
    )
    return False


def pack_linear_weights(model: nn.Module) -> int:
    """Put ``CPUPackedLinearMethod`` on every linear of ``model`` (and its ``lm_head``) whose
    weight oneDNN can take, and pack it; returns how many were packed (0 off the CPU). Call
    once, after ``load_weights`` (vLLM: ``process_weights_after_loading``).

    A bfloat16 weight on a CPU without AMX (``bf16_linears_as_f32``) is also packed upcast
    to float32 (``packed_weight_f32``, twice the bytes), which steps of at least
    ``BF16_AS_F32_MIN_ROWS`` rows use — unless those copies would take more than
    ``F32_COPIES_MAX_SHARE`` of the memory available now (a big model on a small machine):
    then the bfloat16 kernel serves every step, and a log line says so."""
    targets = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):  # ParallelLMHead, or the tied embedding table
        targets.append(head)
    as_f32 = bf16_linears_as_f32()
    if as_f32:
        need = sum(4 * m.weight.numel() for m in targets if m.weight.dtype == torch.bfloat16)
        as_f32 = need > 0 and _f32_copies_fit(need)
    method = CPUPackedLinearMethod(upcast_bf16=as_f32)
    packed = 0
    for module in targets:
        method.process_weights_after_loading(module)
        if module.packed_weight is not None:
            module.linear_method = method
            packed += 1
    return packed
