"""Glassbox's own few-row linear kernel (engine/model/cpu/small_linear_cpu.py): the numbers of
``F.linear`` (float32) and of oneDNN's bfloat16 matmul (bfloat16), its refusals, and the
measured choice that sends a model's linears to it (``--cpu-linear-kernel``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu import linear as cpu_linear
from engine.model.cpu import small_linear_cpu
from engine.model.cpu.linear import choose_linear_kernel
from engine.model.cpu.small_linear_cpu import kernel_unavailable, small_linear


@pytest.fixture(autouse=True)
def own_cache(measured_choices_here, monkeypatch):
    monkeypatch.setattr(cpu_linear, "_kernel_max_rows", {})
    return measured_choices_here


def _needs(dtype: torch.dtype) -> None:
    why = kernel_unavailable(dtype)
    if why:
        pytest.skip(why)


# out features not a multiple of the kernel's 4-row blocks; in features with and without a tail
SHAPES = [(13, 7), (96, 64), (37, 1000)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_float32_equals_f_linear(rows, out_f, in_f):
    _needs(torch.float32)
    g = torch.Generator().manual_seed(rows * out_f)
    x, w, b = (
        torch.randn(rows, in_f, generator=g),
        torch.randn(out_f, in_f, generator=g),
        torch.randn(out_f, generator=g),
    )
    torch.testing.assert_close(small_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_bfloat16_is_the_float32_product_rounded_once(rows, out_f, in_f):
    """bfloat16 operands, float32 products and sums, one rounding: within half a bfloat16 step
    of the float32 product of the same operands, as oneDNN's bfloat16 matmul is."""
    _needs(torch.bfloat16)
    g = torch.Generator().manual_seed(rows + out_f)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float(), b.float())
    got = small_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    # one rounding to bfloat16 (8 bits of mantissa): at most 2^-8 of the value, plus the
    # float32 sums' own order (tiny)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    library = F.linear(x, w, b).float()
    assert (got.float() - library).abs().max() <= library.abs().max() * 2**-7


def test_refuses_what_it_would_read_wrongly():
    _needs(torch.float32)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        small_linear(torch.randn(5, 16), w)
    with pytest.raises(ValueError, match=r"weight must be \(out_features, 16\)"):
        small_linear(torch.randn(1, 16), torch.randn(8, 15))
    with pytest.raises(ValueError, match="contiguous CPU tensor of x's dtype"):
        small_linear(torch.randn(1, 16), torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="contiguous CPU tensor of x's dtype"):
        small_linear(torch.randn(1, 16), w.bfloat16())
    with pytest.raises(ValueError, match=r"bias must be \(8,\)"):
        small_linear(torch.randn(1, 16), w, torch.randn(9))
    assert "float16" in kernel_unavailable(torch.float16)


def kernel_timing(kernel_faster_up_to: int | None, log: list | None = None):
    """(layers, rows) -> times: the kernel twice as fast up to ``kernel_faster_up_to`` rows."""

    def time_linears(layers, rows):
        if log is not None:
            log.append((len(layers), rows))
        work = rows * sum(w.numel() for w, _, _ in layers) * 1e-9
        fast = kernel_faster_up_to is not None and rows <= kernel_faster_up_to
        return {"library": work, "kernel": work / 2 if fast else work * 2}

    return time_linears


def layers(shapes, dtype=torch.bfloat16):
    return [(torch.zeros(o, i, dtype=dtype), torch.zeros(o, i, dtype=dtype), None) for o, i in shapes]


def available(dtype):
    return None


@pytest.mark.parametrize(("faster_up_to", "expect"), [(None, None), (1, 1), (2, 2), (4, 4)])
def test_the_choice_follows_the_measurement(faster_up_to, expect):
    log = []
    v = choose_linear_kernel(layers([(64, 32)] * 3 + [(128, 32)]), "auto",
                             time_linears=kernel_timing(faster_up_to, log), unavailable=available)  # fmt: skip
    assert v.source == "measured" and v.data == {"max_rows": expect}
    assert v.choice == ("off" if expect is None else f"up to {expect} row{'s' if expect > 1 else ''}")
    assert "1 rows: library" in v.detail and "4 rows: library" in v.detail
    assert log == [(4, rows) for rows in cpu_linear.KERNEL_TIMING_ROWS]  # a pass over every layer


def test_the_kernel_must_win_from_one_row_up_and_by_a_margin():
    def time_linears(layers, rows):  # wins at 2 rows only, and at 1 row by 5 %: not enough
        return {1: {"library": 1.05, "kernel": 1.0}, 2: {"library": 2.0, "kernel": 1.0},
                4: {"library": 1.0, "kernel": 2.0}}[rows]  # fmt: skip

    v = choose_linear_kernel(layers([(8, 8)]), "auto", time_linears=time_linears, unavailable=available)
    assert v.data == {"max_rows": None} and v.choice == "off"


def test_forced_unavailable_or_refused(tmp_path):
    def never(layers, rows):
        raise AssertionError("measures nothing")

    v = choose_linear_kernel(layers([(8, 8)]), "on", time_linears=never, unavailable=available)
    assert (v.choice, v.source, v.data) == ("up to 4 rows", "forced by --cpu-linear-kernel", {"max_rows": 4})
    v = choose_linear_kernel(layers([(8, 8)]), "off", time_linears=never, unavailable=available)
    assert (v.choice, v.source, v.data) == ("off", "forced by --cpu-linear-kernel", {"max_rows": None})
    # a CPU without the instructions (or no compiler): off, and the reason in the verdict, even when forced
    v = choose_linear_kernel(
        layers([(8, 8)]), "on", time_linears=never, unavailable=lambda d: "this CPU has no AVX-512"
    )
    assert (v.choice, v.source, v.data) == ("off", "unavailable: this CPU has no AVX-512", {"max_rows": None})
    with pytest.raises(ValueError, match="--cpu-linear-kernel 'fast'.*auto, on, off"):
        choose_linear_kernel(layers([(8, 8)]), "fast")
    from engine.config import ConfigError, ModelConfig
    from tests.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match="--cpu-linear-kernel.*allowed: auto, on, off"):
        ModelConfig(model=str(path), cpu_linear_kernel="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_runs_the_kernel_at_few_rows_only_when_told(dtype, monkeypatch):
    """``pack_linear_weights(..., linear_kernel="on")``: one to four rows go to the kernel,
    more to the library, with the same numbers; ``off``: never the kernel."""
    _needs(dtype)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    from torch import nn

    from engine.model.layers import ColumnParallelLinear

    calls = []
    real = small_linear_cpu.small_linear
    monkeypatch.setattr(small_linear_cpu, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for mode, expect in (("on", [1, 4]), ("off", [])):
        torch.manual_seed(0)
        model = nn.Module()
        model.a = ColumnParallelLinear(64, 96, bias=True).to(dtype)
        with torch.no_grad():  # the layer's own tensors are left uninitialised (a loader fills them)
            model.a.weight.copy_(torch.randn(96, 64))
            model.a.bias.copy_(torch.randn(96))
        cpu_linear.pack_linear_weights(model, bf16_linear="native", f32_linear="packed", linear_kernel=mode,
                                       brgemm_linear="off")  # fmt: skip
        verdict = next(v for v in model.measured_choices if v.name == "linear_kernel")
        assert verdict.name == "linear_kernel" and verdict.source == "forced by --cpu-linear-kernel"
        calls.clear()
        tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
        with torch.inference_mode():
            for rows in (1, 4, 5, 64):
                x = torch.randn(rows, 64).to(dtype)
                want = F.linear(x.float(), model.a.weight.float(), model.a.bias.float())
                torch.testing.assert_close(model.a(x).float(), want, **tol)
        assert calls == expect, mode
