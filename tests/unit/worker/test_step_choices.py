"""A CPU worker's step tuned by timing it (engine/worker/cpu/step_choices.py): the thread count
and compiled-or-eager follow the measurement, a tie keeps the default, a flag or variable
forces a side, and a forward with collectives is never timed on one rank alone."""

from __future__ import annotations

import pytest

from engine.model.cpu import measured_choice
from engine.worker.cpu import step_choices
from engine.worker.cpu.cpu_threads import CpuThreadPlan
from engine.worker.cpu.cpu_worker import _threads_fixed

SHAPES = {"16 decodes": [1] * 16, "a 256-token prefill": [256]}


@pytest.fixture(autouse=True)
def own_cache(measured_choices_here):
    return measured_choices_here


def test_thread_candidates_are_the_share_half_of_it_and_its_physical_cores():
    assert step_choices.thread_candidates(2, 2) == [2, 1]
    assert step_choices.thread_candidates(1, 1) == [1]
    assert step_choices.thread_candidates(8, 4) == [8, 4]  # hyper-threads: half are siblings
    assert step_choices.thread_candidates(12, 3) == [12, 6, 3]
    assert step_choices.thread_candidates(4, None) == [4, 2]


def test_physical_cores_are_read_from_sysfs():
    cores = step_choices.physical_cores_of([0])
    assert cores in (None, 1)
    assert step_choices.physical_cores_of([10**6]) is None  # no such CPU


def fake_threads(ms: dict[int, tuple[float, float]], calls: list):
    def time_threads():
        calls.append(1)
        return {n: {"16 decodes": d / 1e3, "a 256-token prefill": p / 1e3} for n, (d, p) in ms.items()}

    return time_threads


@pytest.mark.parametrize(
    ("ms", "chosen"),
    [
        ({2: (8.0, 20.0), 1: (3.0, 14.0)}, 1),  # fewer threads clearly faster (a tiny model)
        ({2: (4.0, 10.0), 1: (6.0, 19.0)}, 2),  # the share is faster
        ({2: (4.0, 10.0), 1: (3.9, 9.9)}, 2),  # fewer only by 1 %: a tie keeps the share
    ],
)
def test_the_thread_count_follows_the_measurement_and_a_tie_keeps_the_share(ms, chosen):
    calls = []
    v = step_choices.choose_step_threads([2, 1], SHAPES, fake_threads(ms, calls), {"model": "m"})
    assert (v.choice, v.source, v.data) == (str(chosen), "measured", {"threads": chosen})
    assert "16 decodes: 2 threads" in v.detail and "a 256-token prefill" in v.detail
    again = step_choices.choose_step_threads([2, 1], SHAPES, fake_threads(ms, calls), {"model": "m"})
    assert again.source == "cached" and again.data == v.data and len(calls) == 1


def test_timed_while_another_process_holds_a_core_the_share_is_kept_until_a_quiet_start_decides(monkeypatch):
    # Under load one thread always wins (the other core is taken); that verdict, cached, made
    # a 2-core machine run its quiet steps on one thread for good.
    class Busy:
        def others(self) -> float:
            return 1.0

    quiet = measured_choice.load_meter  # the quiet machine of the fixture
    monkeypatch.setattr(measured_choice, "load_meter", Busy)
    calls = []
    one_faster = fake_threads({2: (22.0, 43.0), 1: (9.8, 25.0)}, calls)
    v = step_choices.choose_step_threads([2, 1], SHAPES, one_faster, {"model": "m"})
    assert (v.choice, v.data) == ("2", {"threads": 2})
    assert "the default kept, the machine was busy" in v.detail and "1 measured faster" in v.detail
    busy_compiled = step_choices.choose_compiled_step(
        SHAPES, lambda: {"compiled": dict.fromkeys(SHAPES, 0.03), "eager": dict.fromkeys(SHAPES, 0.01)}, {}
    )
    assert busy_compiled.data == {"compiled": True}
    # The next start is quiet: it measures again, and now the measurement decides.
    monkeypatch.setattr(measured_choice, "load_meter", quiet)
    v = step_choices.choose_step_threads([2, 1], SHAPES, one_faster, {"model": "m"})
    assert (v.source, v.data, len(calls)) == ("measured", {"threads": 1}, 2)


def test_one_candidate_is_not_timed():
    v = step_choices.choose_step_threads([1], SHAPES, lambda: pytest.fail("timed"), {})
    assert (v.choice, v.source) == ("1", "the only candidate")


@pytest.mark.parametrize(
    ("compiled", "eager", "chosen"),
    [
        ((5.0, 20.0), (10.0, 30.0), "compiled"),  # compiled faster
        ((10.0, 30.0), (5.0, 29.0), "compiled"),  # eager wins the decode only
        ((10.0, 30.0), (9.0, 27.0), "compiled"),  # eager 1.11x at both: inside the margin
        ((10.0, 30.0), (8.0, 24.0), "eager"),  # eager 1.25x at both: past the margin (1.2)
    ],
)
def test_eager_replaces_the_compiled_step_only_when_clearly_faster_at_every_shape(compiled, eager, chosen):
    names = list(SHAPES)

    def time_modes():
        return {"compiled": dict(zip(names, [c / 1e3 for c in compiled])),
                "eager": dict(zip(names, [e / 1e3 for e in eager]))}  # fmt: skip

    v = step_choices.choose_compiled_step(SHAPES, time_modes, {"case": (compiled, eager)})
    assert (v.choice, v.data) == (chosen, {"compiled": chosen == "compiled"})
    assert "16 decodes: compiled 10.00 ms" in v.detail or "16 decodes: compiled 5.00 ms" in v.detail


def test_what_fixes_the_thread_count_is_named():
    assert _threads_fixed(CpuThreadPlan(2, None, "auto: 2 usable CPUs, 1 worker(s)")) is None
    fixed = CpuThreadPlan(1, None, "auto: 2 usable CPUs, 1 worker(s), OMP_NUM_THREADS=1")
    assert _threads_fixed(fixed).startswith("OMP_NUM_THREADS=")
    listed = CpuThreadPlan(1, (0,), "GLASSBOX_CPU_OMP_THREADS_BIND=0 for this worker")
    assert _threads_fixed(listed) == "GLASSBOX_CPU_OMP_THREADS_BIND=0 for this worker"
    assert _threads_fixed(CpuThreadPlan(None, None, "GLASSBOX_CPU_OMP_THREADS_BIND=nobind")) is not None


def test_a_forward_with_collectives_is_never_timed_alone():
    from types import SimpleNamespace

    def config(world_size, ep=False):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(world_size=world_size, enable_expert_parallel=ep)
        )

    assert not step_choices.forward_has_collectives(config(1))
    assert step_choices.forward_has_collectives(config(2))
    assert step_choices.forward_has_collectives(config(1, ep=True))


def test_the_timed_steps_fit_the_scheduler_limits():
    assert step_choices.step_shapes(256, 4096, 1024) == {"16 decodes": [1] * 16, "a 256-token prefill": [256]}
    assert step_choices.step_shapes(4, 64, 128) == {"4 decodes": [1] * 4, "a 64-token prefill": [64]}
    # a larger model times a shorter chunk: a 0.5 B model's 256 tokens take seconds on 2 cores
    assert step_choices.step_shapes(256, 4096, 1024, 372_000_000)["a 17-token prefill"] == [17]
    assert step_choices.step_shapes(256, 4096, 1024, 10**10) == {
        "16 decodes": [1] * 16,
        "a 16-token prefill": [16],
    }


@pytest.mark.parametrize(
    ("all_ms", "one_ms", "decode_all", "prefill_all", "words"),
    [
        ((10.0, 30.0), (10.0, 30.0), True, True, "all threads"),  # a tie keeps all
        ((10.0, 30.0), (9.6, 20.0), True, False, "all threads in decode steps, one in prefill steps"),
        ((10.0, 20.0), (9.0, 30.0), False, True, "one thread in decode steps, all in prefill steps"),
        ((10.0, 30.0), (9.0, 27.0), False, False, "one thread"),  # one 1.11x at both: past 1.05
    ],
)  # fmt: skip
def test_the_fused_loops_threads_follow_the_measurement_for_each_kind_of_step(
    all_ms, one_ms, decode_all, prefill_all, words
):
    names = list(SHAPES)

    def time_settings():
        return {"all": dict(zip(names, [t / 1e3 for t in all_ms])),
                "one": dict(zip(names, [t / 1e3 for t in one_ms]))}  # fmt: skip

    v = step_choices.choose_fused_loop_threads(SHAPES, time_settings, {"case": (all_ms, one_ms)})
    assert (v.choice, v.data) == (words, {"decode_all": decode_all, "prefill_all": prefill_all})
    assert f"16 decodes: all threads {all_ms[0]:.2f} ms, one thread {one_ms[0]:.2f} ms" in v.detail


def test_the_fused_loops_threads_are_forced_by_their_variable_and_a_bad_value_is_refused():
    assert step_choices.forced_fused_loop_threads("auto") is None
    one = step_choices.forced_fused_loop_threads("one")
    assert (one.choice, one.source) == ("one thread", "forced by GLASSBOX_CPU_FUSED_LOOP_THREADS=one")
    assert step_choices.forced_fused_loop_threads("all").data == {"decode_all": True, "prefill_all": True}
    from engine import envs

    with pytest.raises(ValueError, match="expected one of auto, one, all"):
        envs._fused_loop_threads("two")


def test_a_compiled_step_runs_its_loops_with_the_chosen_count_and_puts_torchs_back():
    """``compiled_step_threads``: the count Inductor's loops read during the compiled call —
    the step's threads for a kind of step whose loops use all, one thread otherwise."""
    import torch

    from engine.model.cpu import op_threads

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        op_threads.set_op_threads(2)
        op_threads.set_fused_loop_threads(decode_all=False, prefill_all=True)
        with op_threads.compiled_step_threads(has_prefill=False):
            assert torch.get_num_threads() == 1
        with op_threads.compiled_step_threads(has_prefill=True):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 3
    finally:
        op_threads.set_op_threads(None)
        op_threads.set_fused_loop_threads(True, True)
        torch.set_num_threads(saved)
