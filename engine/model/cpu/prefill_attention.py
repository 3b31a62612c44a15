"""bfloat16 prefill attention natively or in float32 on a CPU, whichever measured faster.

Prefill chunks go through ``F.scaled_dot_product_attention`` (``engine/model/attention.py``,
``_sdpa``). On a CPU, how fast torch's SDPA kernels run in bfloat16 against float32 depends
on the CPU: on the Intel Xeon of docs/performance.md (AVX512-BF16, no AMX) the bfloat16
flash kernel was 2.3× slower than float32 with the casts, on an AMD EPYC (Zen 4) it is about
3× faster. So ``choose_bf16_prefill_attention`` times both at the model's heads (one causal
chunk of 256 and of 512 tokens, one 128-token chunk after 384 cached tokens with an explicit
mask, at the worker's thread count; ``measured_choice.py``: interleaved, medians, cached per
CPU) and sets ``engine.model.attention.sdpa_upcast_on_cpu``. ``--cpu-bf16-attention
native|upcast`` forces a side. Either way the softmax accumulates in float32 inside the
kernel; the results differ only by bfloat16 rounding of the inputs' products.

vLLM counterpart: none — its CPU backend (``cpu_attn.py``) has one prefill kernel per ISA.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import CPU_BF16_MODES
from engine.model import attention as reference
from engine.model.cpu.measured_choice import Verdict, measured, time_candidates
from engine.model.cpu.op_threads import get_op_threads, op_threads

# The upcast path must be at least this much faster to be chosen (a tie keeps the model's dtype).
UPCAST_MIN_GAIN = 1.1
# (query tokens, cached tokens before them) of the chunks timed.
TIMED_CHUNKS = ((256, 0), (512, 0), (128, 384))


def _time_sdpa(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the ``TIMED_CHUNKS`` through SDPA in ``dtype`` (``native``) and in float32
    with the casts (``upcast``), medians of interleaved rounds."""
    cases = []
    for n, context in TIMED_CHUNKS:
        s = n + context
        q = torch.randn(1, num_heads, n, head_dim, dtype=dtype)
        k = torch.randn(1, num_kv_heads, s, head_dim, dtype=dtype)
        v = torch.randn(1, num_kv_heads, s, head_dim, dtype=dtype)
        mask = None if context == 0 else torch.arange(s)[None, :] <= torch.arange(context, s)[:, None]
        cases.append((q, k, v, mask))
    gqa = num_kv_heads != num_heads

    def native() -> None:
        for q, k, v, mask in cases:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)

    def upcast() -> None:
        for q, k, v, mask in cases:
            F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            ).to(dtype)

    with torch.inference_mode(), op_threads():
        return time_candidates({"native": native, "upcast": upcast}, rounds=5, timer=time.perf_counter)


def choose_bf16_prefill_attention(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    mode: str = "auto",
    time_sdpa: Callable[[int, int, int, torch.dtype], dict[str, float]] | None = None,
) -> Verdict:
    """Whether prefill attention of a ``dtype`` model runs in float32 on this CPU.

    Args:
        num_heads, num_kv_heads, head_dim: one attention layer's, on this rank.
        mode: ``--cpu-bf16-attention``: ``auto`` (measure, or an earlier start's verdict),
            ``native`` or ``upcast`` (forced).
        time_sdpa: ``(heads, kv_heads, head_dim, dtype) -> {"native": s, "upcast": s}``;
            tests pass a fake.

    Returns:
        A ``Verdict`` with ``data["upcast"]``: True where float32 measured at least
        ``UPCAST_MIN_GAIN``× faster.
    """
    if mode not in CPU_BF16_MODES:
        raise ValueError(f"--cpu-bf16-attention {mode!r}: allowed: {', '.join(CPU_BF16_MODES)}")
    if mode != "auto":
        return Verdict(
            "bf16_attention", mode, "forced by --cpu-bf16-attention", data={"upcast": mode == "upcast"}
        )
    time_one = time_sdpa or _time_sdpa

    def measure() -> tuple[str, str, dict]:
        t = time_one(num_heads, num_kv_heads, head_dim, dtype)
        upcast = t["native"] >= UPCAST_MIN_GAIN * t["upcast"]
        chunks = ", ".join(f"{n} after {c}" if c else f"{n}" for n, c in TIMED_CHUNKS)
        detail = f"prefill chunks of {chunks} tokens: native {1e3 * t['native']:.2f} ms, upcast {1e3 * t['upcast']:.2f} ms"
        return ("upcast" if upcast else "native"), detail, {"upcast": upcast}

    key = {"heads": [num_heads, num_kv_heads, head_dim], "dtype": str(dtype), "threads": get_op_threads(),
           "chunks": TIMED_CHUNKS, "min_gain": UPCAST_MIN_GAIN}  # fmt: skip
    return measured("bf16_attention", key, measure)


def tune_prefill_attention(model: nn.Module, mode: str = "auto") -> Verdict | None:
    """For a bfloat16/float16 model on the CPU: choose (``choose_bf16_prefill_attention``) and
    set ``engine.model.attention.sdpa_upcast_on_cpu``; append the verdict to
    ``model.measured_choices``. None (and nothing changed) for other models."""
    layer = next((m for m in model.modules() if isinstance(m, reference.Attention)), None)
    param = next(model.parameters(), None)
    if layer is None or param is None or param.device.type != "cpu":
        return None
    if param.dtype not in (torch.bfloat16, torch.float16):
        return None
    verdict = choose_bf16_prefill_attention(
        layer.num_heads, layer.num_kv_heads, layer.head_dim, param.dtype, mode
    )
    reference.sdpa_upcast_on_cpu = bool(verdict.data["upcast"])
    model.measured_choices = [*getattr(model, "measured_choices", []), verdict]
    return verdict
