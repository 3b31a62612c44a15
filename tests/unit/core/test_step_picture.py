"""The one-step timeline (``docs/pictures/one-step-threads.svg``): current, and true to its trace.

``engine/core/step_picture.py`` draws it from the trace lesson 5 ships
(``tutorials/data/05-one-engine-step/step-trace.jsonl``); the committed SVG must be exactly
what it draws today, and the lanes must be the threads the spans say they ran on.
"""

from __future__ import annotations

from engine.core import step_picture
from engine.distributed.pictures import DOCS_DIR

REGENERATE = "regenerate: python -m engine.distributed.pictures"


def test_the_committed_picture_is_current(tmp_path):
    (path,) = step_picture.write_pictures(tmp_path)
    committed = DOCS_DIR / step_picture.FILE_NAME
    assert committed.exists(), REGENERATE
    assert committed.read_bytes() == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_each_span_is_drawn_on_the_thread_it_ran_on():
    drawn, total_ms = step_picture.layout(step_picture.load())
    lanes = {s.name: step_picture.LANES[s.lane][1] for s in drawn if s.step_id in (1, None)}
    assert lanes["engine_core.input"] == "EngineCoreInputThread"
    assert lanes["engine_core.output_send"] == "EngineCoreOutputThread"
    assert lanes["engine_core.step"] == lanes["scheduler.schedule"] == "MainThread"
    worker = {s.name for s in drawn if step_picture.LANES[s.lane][0] == "Worker"}
    assert worker == {"worker.execute_model", "model_runner.forward", "model_runner.sample"}
    # one step: schedule, then execute (the worker's forward inside it), then update, then the send
    t = {s.name: s for s in drawn if s.step_id in (1, None)}
    assert t["engine_core.input"].end_ms <= t["engine_core.step"].start_ms
    assert t["scheduler.schedule"].end_ms <= t["executor.execute_model"].start_ms
    assert t["executor.execute_model"].start_ms < t["worker.execute_model"].start_ms
    assert t["worker.execute_model"].end_ms <= t["executor.execute_model"].end_ms
    assert t["executor.execute_model"].end_ms <= t["scheduler.update_from_output"].start_ms
    assert t["scheduler.update_from_output"].end_ms <= t["engine_core.output_send"].start_ms
    # and the next step began before the output thread was done with this one
    next_step = next(s for s in drawn if s.name == "engine_core.step" and s.step_id == 2)
    assert next_step.start_ms < t["engine_core.output_send"].start_ms < total_ms
