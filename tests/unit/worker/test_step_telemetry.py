"""The worker's step telemetry: counted steps, their times, and the compile text."""

import pytest

from engine.worker.step_telemetry import WorkerStepTelemetry, compile_text
from tracing.telemetry import events


def test_a_step_is_counted_and_timed_and_a_failed_one_is_not():
    t = WorkerStepTelemetry()
    with t.step(None):
        pass
    with pytest.raises(RuntimeError), t.step(None):
        raise RuntimeError("the forward failed")
    gauges = t.gauges()
    assert gauges[events.GAUGE_WORKER_STEP] == 1
    assert gauges[events.GAUGE_WORKER_FORWARD_MS] >= 0.0
    assert t.execute_model_s == pytest.approx(gauges[events.GAUGE_WORKER_FORWARD_MS] / 1e3)


def test_compile_text():
    assert compile_text("eager", 0) == "eager"
    assert compile_text("inductor", 1) == "compiled (inductor, 1 graph)"
    assert compile_text("inductor", 2, late=1) == "compiled (inductor, 2 graphs, 1 after warm-up)"
