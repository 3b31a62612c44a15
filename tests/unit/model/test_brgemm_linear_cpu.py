"""bfloat16 linears through torch's brgemm micro-kernel (engine/model/cpu/brgemm_linear_cpu.py):
oneDNN's bfloat16 matmul's numbers at every row count, its refusals, and the measured choice
that sends a model's bfloat16 linears to it (``--cpu-brgemm-linear``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu import brgemm_linear_cpu
from engine.model.cpu import linear as cpu_linear
from engine.model.cpu.brgemm_linear_cpu import brgemm_linear, kernel_unavailable, pack_weight
from engine.model.cpu.linear import choose_brgemm_linear


@pytest.fixture(autouse=True)
def own_cache(measured_choices_here, monkeypatch):
    monkeypatch.setattr(cpu_linear, "_kernel_max_rows", {})
    monkeypatch.setattr(cpu_linear, "_brgemm_max_rows", None)
    return measured_choices_here


def _needs_kernel() -> None:
    why = kernel_unavailable(torch.bfloat16)
    if why:
        pytest.skip(why)


# out features past a 64-wide block and not a multiple of it; in features small and large
SHAPES = [(13, 30), (100, 64), (130, 1000)]


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 200])
@pytest.mark.parametrize(("out_f", "in_f"), SHAPES)
def test_is_the_float32_product_rounded_once(rows, out_f, in_f):
    """bfloat16 operands, float32 products and sums, the bias added, one rounding: within half
    a bfloat16 step of the float32 result, as oneDNN's bfloat16 matmul is; rows across the
    64-row blocks, columns across the 64-wide packed blocks."""
    _needs_kernel()
    g = torch.Generator().manual_seed(rows + out_f)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16()
    packed = pack_weight(w)
    for bias in (b, None):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = brgemm_linear(x, packed, out_f, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
        # float32 sums in another order: a rounding may land one bfloat16 step away
        torch.testing.assert_close(got.float(), want, rtol=2 * 2**-8, atol=1e-3 * want.abs().max().item())


def test_refusals():
    _needs_kernel()
    w = torch.randn(64, 32).bfloat16()
    packed = pack_weight(w)
    with pytest.raises(ValueError, match="bfloat16"):
        pack_weight(w.float())
    with pytest.raises(ValueError, match="in_features must be even"):
        pack_weight(torch.randn(8, 7).bfloat16())
    with pytest.raises(ValueError, match="x must be a contiguous 2-D bfloat16"):
        brgemm_linear(torch.randn(2, 32), packed, 64)
    with pytest.raises(ValueError, match="not a packed \\(129, 32\\) weight"):
        brgemm_linear(torch.randn(2, 32).bfloat16(), packed, 65 + 64)
    with pytest.raises(ValueError, match="bias must be \\(64,\\) bfloat16"):
        brgemm_linear(torch.randn(2, 32).bfloat16(), packed, 64, torch.zeros(64))
    assert "bfloat16 only" in kernel_unavailable(torch.float32)


def layers(shapes):
    return [(torch.zeros(o, i, dtype=torch.bfloat16), torch.zeros(1), None) for o, i in shapes]


def available(dtype):
    return None


def brgemm_timing(faster_up_to, log):
    def time_linears(layers, rows):
        log.append((len(layers), rows))
        assert all(p.numel() >= w.numel() for w, _, _, p in layers)  # each weight packed for it
        wins = faster_up_to is not None and rows <= faster_up_to
        return {"library": 2.0 if wins else 1.0, "brgemm": 1.0 if wins else 2.0}

    return time_linears


@pytest.mark.parametrize(("faster_up_to", "expect"), [(None, None), (8, 8), (32, 32), (128, 128)])
def test_the_choice_follows_the_measurement(faster_up_to, expect):
    _needs_kernel()  # measuring packs the weights
    log = []
    v = choose_brgemm_linear(layers([(64, 32)] * 3 + [(128, 32)]), "auto",
                             time_linears=brgemm_timing(faster_up_to, log), unavailable=available)  # fmt: skip
    assert v.source == "measured" and v.data == {"max_rows": expect}
    assert v.choice == ("off" if expect is None else f"up to {expect} rows")
    assert "8 rows: library" in v.detail and "128 rows: library" in v.detail
    assert log == [(4, rows) for rows in cpu_linear.BRGEMM_TIMING_ROWS]  # a pass over every layer
    # a second start reads the verdict: nothing timed
    again = choose_brgemm_linear(layers([(64, 32)] * 3 + [(128, 32)]), "auto",
                                 time_linears=brgemm_timing(None, log), unavailable=available)  # fmt: skip
    assert again.data == {"max_rows": expect} and again.source == "cached" and len(log) == 5


def test_a_tie_is_enough_but_a_loss_ends_the_run():
    _needs_kernel()

    def time_linears(layers, rows):  # a tie at 8 rows, a win at 16, a loss at 32 and a win after
        return {8: {"library": 1.0, "brgemm": 1.0}, 16: {"library": 2.0, "brgemm": 1.0},
                32: {"library": 1.0, "brgemm": 1.1}}.get(rows, {"library": 2.0, "brgemm": 1.0})  # fmt: skip

    v = choose_brgemm_linear(layers([(8, 8)]), "auto", time_linears=time_linears, unavailable=available)
    assert v.data == {"max_rows": 16} and v.choice == "up to 16 rows"


def test_forced_unavailable_or_refused(tmp_path):
    def never(layers, rows):
        raise AssertionError("measures nothing")

    v = choose_brgemm_linear(layers([(8, 8)]), "on", time_linears=never, unavailable=available)
    assert (v.choice, v.source) == ("every row count", "forced by --cpu-brgemm-linear")
    assert v.data["max_rows"] >= 2**31 - 1
    v = choose_brgemm_linear(layers([(8, 8)]), "off", time_linears=never, unavailable=available)
    assert (v.choice, v.source, v.data) == ("off", "forced by --cpu-brgemm-linear", {"max_rows": None})
    v = choose_brgemm_linear(layers([(8, 8)]), "on", time_linears=never, unavailable=lambda d: "no AMX here")
    assert (v.choice, v.source, v.data) == ("off", "unavailable: no AMX here", {"max_rows": None})
    v = choose_brgemm_linear(layers([(8, 7)]), "auto", time_linears=never, unavailable=available)
    assert v.source == "unavailable: a weight of shape (8, 7) has an odd number of inputs"
    with pytest.raises(ValueError, match="--cpu-brgemm-linear 'fast'.*auto, on, off"):
        choose_brgemm_linear(layers([(8, 8)]), "fast")
    from engine.config import ConfigError, ModelConfig
    from tests.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match="--cpu-brgemm-linear.*allowed: auto, on, off"):
        ModelConfig(model=str(path), cpu_brgemm_linear="fast")


def test_a_packed_layer_runs_the_micro_kernel_only_when_told(monkeypatch):
    """``pack_linear_weights(..., brgemm_linear="on")``: every bfloat16 row count past the few
    rows of our own kernel goes to the micro-kernel, with oneDNN's numbers; ``off``: never."""
    _needs_kernel()
    from torch import nn

    from engine.model.layers import ColumnParallelLinear

    calls = []
    real = brgemm_linear_cpu.brgemm_linear
    monkeypatch.setattr(
        brgemm_linear_cpu, "brgemm_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    for mode, expect in (("on", [5, 64, 300]), ("off", [])):
        torch.manual_seed(0)
        model = nn.Module()
        model.a = ColumnParallelLinear(64, 96, bias=True).to(torch.bfloat16)
        with torch.no_grad():  # the layer's own tensors are left uninitialised (a loader fills them)
            model.a.weight.copy_(torch.randn(96, 64))
            model.a.bias.copy_(torch.randn(96))
        cpu_linear.pack_linear_weights(model, bf16_linear="native", linear_kernel="on", brgemm_linear=mode)
        verdict = model.measured_choices[-1]
        assert verdict.name == "brgemm_linear" and verdict.source == "forced by --cpu-brgemm-linear"
        assert (getattr(model.a, "packed_weight_brgemm", None) is not None) == (mode == "on")
        calls.clear()
        with torch.inference_mode():
            for rows in (4, 5, 64, 300):
                x = torch.randn(rows, 64).bfloat16()
                want = F.linear(x.float(), model.a.weight.float(), model.a.bias.float())
                torch.testing.assert_close(model.a(x).float(), want, rtol=2e-2, atol=5e-2)
        assert calls == expect, mode
