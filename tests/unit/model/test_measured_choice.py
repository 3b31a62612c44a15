"""Speed choices by measurement (engine/model/cpu/measured_choice.py): the choice follows the
timings, is cached per machine and shapes, and a flag forces it without measuring."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model.cpu import linear as cpu_linear
from engine.model.cpu import measured_choice
from engine.model.cpu.linear import choose_bf16_linear, choose_f32_linear
from engine.model.cpu.measured_choice import time_candidates


class FixedLoad:
    """Other processes' load during a measurement, as the test sets it (the real one follows
    the machine: the suite's other tests)."""

    cpus = 0.0

    def others(self) -> float:
        return FixedLoad.cpus


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(measured_choice, "load_meter", FixedLoad)
    monkeypatch.setattr(FixedLoad, "cpus", 0.0)
    return tmp_path


class FakeClock:
    """A clock the candidates advance by their own (made-up) cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_candidates_interleaves_rounds_and_takes_medians():
    clock, calls = FakeClock(), []
    costs = {"a": iter([9.0, 1.0, 1.0, 50.0, 1.0, 1.0]), "b": iter([9.0, 2.0, 2.0, 2.0, 2.0, 2.0])}

    def candidate(name):
        def run():
            calls.append(name)
            clock.now += next(costs[name])

        return run

    got = time_candidates({"a": candidate("a"), "b": candidate("b")}, rounds=5, timer=clock)
    # one warm-up call each (not counted), then a, b, a, b, ...: a's burst of 50 is out-voted
    assert calls == ["a", "b"] + ["a", "b"] * 5
    assert got == {"a": 1.0, "b": 2.0}


def weights(shapes):
    return [torch.zeros(o, i, dtype=torch.bfloat16) for o, i in shapes]


def fake_timing(upcast_faster_from: int | None, log: list):
    """(weight, rows) -> times: upcast twice as fast from ``upcast_faster_from`` rows on."""

    def time_linear(w, rows):
        log.append((tuple(w.shape), rows))
        work = rows * w.numel() * 1e-9
        fast = upcast_faster_from is not None and rows >= upcast_faster_from
        return {"native": work, "upcast": work / 2 if fast else work * 2}

    return time_linear


@pytest.mark.parametrize(("faster_from", "expect"), [(None, None), (64, 64), (1, 16), (256, 256)])
def test_the_bf16_choice_follows_the_measurement(faster_from, expect):
    log = []
    model = weights([(64, 32)] * 3 + [(128, 32)])
    v = choose_bf16_linear(model, "auto", time_linear=fake_timing(faster_from, log))
    assert v.source == "measured" and v.data == {"min_rows": expect}
    assert v.choice == ("native" if expect is None else f"upcast from {expect} rows")
    # each distinct shape timed once per row count, not each layer
    assert sorted(set(log)) == sorted(log) and len(log) == 2 * len(cpu_linear.BF16_TIMING_ROWS)
    assert "256 rows: native" in v.detail


def test_upcast_must_win_at_every_larger_row_count_and_by_a_margin():
    def time_linear(w, rows):  # upcast wins at 64 only, and at 256 only by 5 %: not enough
        return {16: {"native": 1.0, "upcast": 2.0}, 64: {"native": 2.0, "upcast": 1.0},
                256: {"native": 1.05, "upcast": 1.0}}[rows]  # fmt: skip

    v = choose_bf16_linear(weights([(8, 8)]), "auto", time_linear=time_linear)
    assert v.data == {"min_rows": None} and v.choice == "native"


def test_the_verdict_is_cached_per_shapes_and_machine(own_cache, monkeypatch):
    log = []
    model = weights([(64, 32)])
    first = choose_bf16_linear(model, "auto", time_linear=fake_timing(64, log))
    timed = len(log)
    again = choose_bf16_linear(model, "auto", time_linear=fake_timing(None, log))
    assert len(log) == timed, "a second start with the same key measures nothing"
    assert (again.source, again.data, again.detail) == ("cached", first.data, first.detail)
    files = list((own_cache / "measured_choices").glob("bf16_linear-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["data"] == {"min_rows": 64}
    # other shapes, or another CPU: a new measurement
    assert (
        choose_bf16_linear(weights([(96, 32)]), "auto", time_linear=fake_timing(None, log)).source
        == "measured"
    )
    monkeypatch.setattr(
        measured_choice, "cpu_identity", lambda: {"model": "Other CPU", "flags": ["amx_bf16"]}
    )
    other = choose_bf16_linear(model, "auto", time_linear=fake_timing(None, log))
    assert other.source == "measured" and other.data == {"min_rows": None}


def test_a_corrupt_cache_file_is_measured_again(own_cache):
    log = []
    model = weights([(64, 32)])
    choose_bf16_linear(model, "auto", time_linear=fake_timing(16, log))
    (path,) = (own_cache / "measured_choices").glob("*.json")
    path.write_text("{not json")
    v = choose_bf16_linear(model, "auto", time_linear=fake_timing(None, log))
    assert v.source == "measured" and v.data == {"min_rows": None}


@pytest.mark.parametrize(("mode", "min_rows"), [("native", None), ("upcast", 1)])
def test_the_flag_forces_a_side_without_measuring(mode, min_rows):
    def never(w, rows):
        raise AssertionError("a forced choice measures nothing")

    v = choose_bf16_linear(weights([(8, 8)]), mode, time_linear=never)
    assert (v.choice, v.source, v.data) == (mode, "forced by --cpu-bf16-linear", {"min_rows": min_rows})
    with pytest.raises(ValueError, match="--cpu-bf16-linear 'fast'.*auto, native, upcast"):
        choose_bf16_linear(weights([(8, 8)]), "fast")


def test_bad_flag_is_refused_in_the_config(tmp_path):
    from engine.config import ConfigError, ModelConfig
    from tests.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match="--cpu-bf16-linear.*allowed: auto, native, upcast"):
        ModelConfig(model=str(path), cpu_bf16_linear="fast")


def test_on_this_cpu_the_real_measurement_is_quick_and_drives_the_linears(tmp_path):
    """The real timer at a small model's shapes: seconds at most, and the layers do what the
    verdict says (float32 copies exactly where upcast was chosen)."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 matmul in oneDNN")
    from torch import nn

    from engine.model.layers import ColumnParallelLinear

    model = nn.Module()
    model.a = ColumnParallelLinear(256, 512, bias=False)
    model.a.weight.data = model.a.weight.data.bfloat16()
    assert cpu_linear.pack_linear_weights(model) == 1
    verdict, kernel, brgemm = model.measured_choices
    assert verdict.source == "measured" and verdict.seconds < 10
    assert (model.a.packed_weight_f32 is not None) == (verdict.data["min_rows"] is not None)
    # then whether our own kernel takes the few-row steps: measured too (or unavailable here)
    assert kernel.name == "linear_kernel"
    assert kernel.source == "measured" or kernel.source.startswith("unavailable: "), kernel.source
    assert cpu_linear._kernel_max_rows.get(torch.bfloat16) == kernel.data["max_rows"]
    assert kernel.seconds < 10
    # and whether torch's brgemm micro-kernel takes the rest: measured (or unavailable here)
    assert brgemm.name == "brgemm_linear"
    assert brgemm.source == "measured" or brgemm.source.startswith("unavailable: "), brgemm.source
    assert cpu_linear._brgemm_max_rows == brgemm.data["max_rows"] and brgemm.seconds < 10
    assert (getattr(model.a, "packed_weight_brgemm", None) is not None) == (
        brgemm.data["max_rows"] is not None
    )


@pytest.mark.parametrize(
    ("native_s", "upcast_s", "upcast"), [(3.0, 1.0, True), (1.0, 3.0, False), (1.05, 1.0, False)]
)
def test_the_prefill_attention_choice_follows_the_measurement_and_sets_the_reference(
    monkeypatch, native_s, upcast_s, upcast
):
    from engine.model import attention
    from engine.model.cpu import prefill_attention

    monkeypatch.setattr(attention, "sdpa_upcast_on_cpu", not upcast)
    asked = []

    def fake(heads, kv_heads, head_dim, dtype):
        asked.append((heads, kv_heads, head_dim, dtype))
        return {"native": native_s, "upcast": upcast_s}

    monkeypatch.setattr(prefill_attention, "_time_sdpa", fake)
    model = torch.nn.Module()
    model.attn = attention.Attention(num_heads=8, head_dim=16, num_kv_heads=2, scale=0.25)
    model.proj = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
    verdict = prefill_attention.tune_prefill_attention(model)
    assert asked == [(8, 2, 16, torch.bfloat16)]
    assert (verdict.source, verdict.data) == ("measured", {"upcast": upcast})
    assert attention.sdpa_upcast_on_cpu is upcast and model.measured_choices == [verdict]
    # the same heads again: cached, not measured
    assert prefill_attention.tune_prefill_attention(model).source == "cached" and len(asked) == 1


def test_prefill_attention_forced_or_float32_measures_nothing(monkeypatch):
    from engine.model import attention
    from engine.model.cpu import prefill_attention

    monkeypatch.setattr(attention, "sdpa_upcast_on_cpu", True)
    monkeypatch.setattr(prefill_attention, "_time_sdpa", lambda *a: pytest.fail("measured"))
    model = torch.nn.Module()
    model.attn = attention.Attention(num_heads=4, head_dim=8, num_kv_heads=4, scale=1.0)
    model.proj = torch.nn.Linear(4, 4)  # float32: nothing to choose
    assert prefill_attention.tune_prefill_attention(model) is None and attention.sdpa_upcast_on_cpu
    model.proj = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
    v = prefill_attention.tune_prefill_attention(model, "native")
    assert (v.choice, v.source) == (
        "native",
        "forced by --cpu-bf16-attention",
    ) and not attention.sdpa_upcast_on_cpu


def test_bf16_prefill_attention_native_and_upcast_agree_within_bfloat16_rounding(monkeypatch):
    """Either side of the choice computes the same attention (float32 softmax inside the kernel):
    the prefill's output differs only by bfloat16 rounding."""
    from engine.model import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 16).bfloat16() for _ in range(3))
    outs = []
    for upcast in (True, False):
        monkeypatch.setattr(attention, "sdpa_upcast_on_cpu", upcast)
        outs.append(attention._sdpa(q, k, v, is_causal=True).float())
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    for out in outs:
        torch.testing.assert_close(out, exact.float(), atol=2e-2, rtol=2**-7)


def test_a_verdict_measured_while_the_machine_was_busy_is_measured_again_a_bounded_number_of_times():
    calls = []

    def measure():
        calls.append(1)
        return "a", "timed", {"x": len(calls)}

    FixedLoad.cpus = 1.2  # another process took more than a CPU of ours
    first = measured_choice.measured("demo", {"k": 1}, measure)
    assert first.source == "measured" and "other processes took 1.2 CPU meanwhile" in first.detail
    for _ in range(measured_choice.REMEASURE_BUSY):
        assert measured_choice.measured("demo", {"k": 1}, measure).source == "measured"
    # still busy each time: after REMEASURE_BUSY more tries the last verdict stands
    assert measured_choice.measured("demo", {"k": 1}, measure).source == "cached"
    assert len(calls) == 1 + measured_choice.REMEASURE_BUSY
    # a quiet measurement is cached at once
    FixedLoad.cpus = 0.1
    measured_choice.measured("demo", {"k": 2}, measure)
    assert measured_choice.measured("demo", {"k": 2}, measure).source == "cached"


# ------------------------------------------------------------------ float32 linears at a few rows


def f32_timing(plain_faster_up_to: int | None, log: list | None = None):
    """(layers, rows) -> times: the plain matmul twice as fast up to ``plain_faster_up_to`` rows."""

    def time_linears(layers, rows):
        if log is not None:
            log.append((len(layers), rows))
        work = rows * sum(w.numel() for w, _ in layers) * 1e-9
        fast = plain_faster_up_to is not None and rows <= plain_faster_up_to
        return {"packed": work, "plain": work / 2 if fast else work * 2}

    return time_linears


def f32_layers(shapes):
    return [(torch.zeros(o, i), torch.zeros(o, i)) for o, i in shapes]


@pytest.mark.parametrize(("faster_up_to", "expect"), [(None, None), (1, 1), (2, 2), (4, 4), (64, 4)])
def test_the_f32_choice_follows_the_measurement(faster_up_to, expect):
    log = []
    v = choose_f32_linear(
        f32_layers([(64, 32)] * 3 + [(128, 32)]), "auto", time_linears=f32_timing(faster_up_to, log)
    )
    assert v.source == "measured" and v.data == {"max_rows": expect}
    assert v.choice == (
        "packed" if expect is None else f"plain up to {expect} row{'s' if expect > 1 else ''}"
    )
    assert "1 rows: packed" in v.detail and "4 rows: packed" in v.detail
    # a pass over every layer (a weight timed alone stays in the cache), once per row count
    assert log == [(4, rows) for rows in cpu_linear.F32_TIMING_ROWS]


def test_the_plain_matmul_must_win_at_every_smaller_row_count_and_by_a_margin():
    def time_linears(layers, rows):  # plain wins at 2 rows only, and at 1 row by 5 %: not enough
        return {1: {"packed": 1.05, "plain": 1.0}, 2: {"packed": 2.0, "plain": 1.0},
                4: {"packed": 1.0, "plain": 2.0}}[rows]  # fmt: skip

    v = choose_f32_linear(f32_layers([(8, 8)]), "auto", time_linears=time_linears)
    assert v.data == {"max_rows": None} and v.choice == "packed"


@pytest.mark.parametrize(("mode", "max_rows"), [("packed", None), ("plain", cpu_linear._EVERY_ROW_COUNT)])
def test_the_f32_flag_forces_a_side_without_measuring(mode, max_rows, tmp_path):
    def never(layers, rows):
        raise AssertionError("a forced choice measures nothing")

    v = choose_f32_linear(f32_layers([(8, 8)]), mode, time_linears=never)
    assert (v.choice, v.source, v.data) == (mode, "forced by --cpu-f32-linear", {"max_rows": max_rows})
    with pytest.raises(ValueError, match="--cpu-f32-linear 'fast'.*auto, packed, plain"):
        choose_f32_linear(f32_layers([(8, 8)]), "fast")
    from engine.config import ConfigError, ModelConfig
    from tests.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match="--cpu-f32-linear.*allowed: auto, packed, plain"):
        ModelConfig(model=str(path), cpu_f32_linear="fast")


@pytest.mark.parametrize("mode", ["packed", "plain"])
def test_a_f32_linear_gives_the_same_numbers_either_way_and_runs_as_told(mode, monkeypatch):
    """Either side computes the same float32 product (to float32 rounding); ``plain`` runs
    torch's matmul on the weight as it is, ``packed`` oneDNN's call — at one row and at 64."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    from torch import nn

    from engine.model.layers import ColumnParallelLinear

    torch.manual_seed(0)
    model = nn.Module()
    model.a = ColumnParallelLinear(64, 96, bias=True)
    with torch.no_grad():  # the layer's own tensors are left uninitialised (a loader fills them)
        model.a.weight.copy_(torch.randn(96, 64))
        model.a.bias.copy_(torch.randn(96))
    assert cpu_linear.pack_linear_weights(model, f32_linear=mode, linear_kernel="off") == 1
    assert [v.name for v in model.measured_choices] == ["f32_linear", "linear_kernel"]
    calls = []
    real_pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append("packed") or real_pointwise(*a), raising=False)  # fmt: skip
    with torch.inference_mode():
        for rows in (1, 64):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(model.a(x), x @ model.a.weight.T + model.a.bias, rtol=1e-5, atol=1e-5)
    assert calls == ([] if mode == "plain" else ["packed", "packed"])


def cpuinfo(family: int, model: int, flags: str = "fma avx2 avx512f avx512_bf16 avx512_vnni") -> str:
    """The first two processors of a /proc/cpuinfo as a KVM guest on an AMD EPYC shows them."""
    block = (f"processor\t: {{n}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu sse2 {flags}\n\n")  # fmt: skip
    return block.format(n=0) + block.format(n=1)


def test_two_cpus_a_vm_names_alike_keep_verdicts_of_their_own(monkeypatch):
    """A Zen 4 (family 25) and a Zen 5 (family 26) both read "AMD EPYC" with the same flags in
    a VM, and their fastest kernels differ: a verdict cached on one is not the other's."""
    zen4, zen5 = measured_choice.cpu_identity(cpuinfo(25, 17)), measured_choice.cpu_identity(cpuinfo(26, 2))
    assert zen4 == {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": 25, "model_number": 17,
                    "flags": ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]}  # fmt: skip
    assert zen5["family"] == 26 and zen5["model_number"] == 2 and zen5["flags"] == zen4["flags"]
    paths = []
    for ident in (zen4, zen5, zen4):
        monkeypatch.setattr(measured_choice, "cpu_identity", lambda ident=ident: ident)
        paths.append(measured_choice.cache_path("bf16_linear", {"shapes": [[64, 32]]}))
    assert paths[0] != paths[1] and paths[0] == paths[2]
