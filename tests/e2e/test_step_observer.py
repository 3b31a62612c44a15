"""The engine core's step observers: one ``StepRecord`` per step, with the figures a user reads.

An in-process engine (``InprocClient``) on a tiny checkpoint serves two prompts of 3 and 5
tokens for 4 tokens each. Predict the steps before reading the assertions: the first
schedules both prompts whole (8 prefill tokens) and samples each one's first token; the
next three decode one token per request (2 tokens a step); the fourth step ends both.
"""

from __future__ import annotations

import msgspec
import pytest

from engine import LLM, SamplingParams
from engine.core.step_observer import StepObserver


class Recorder(StepObserver):
    def __init__(self) -> None:
        self.steps: list[tuple] = []  # (record, what the scheduler output said)
        self.updated: list[int] = []  # step ids seen by on_update, inside the update span

    def on_update(self, record, step_span, update_span) -> None:
        self.updated.append(record.step_id)

    def on_step(self, record, scheduler_output, outputs) -> None:
        said = (scheduler_output.total_num_scheduled_tokens, len(scheduler_output.scheduled_new_reqs))
        self.steps.append((record, said))


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")


def test_an_observer_gets_one_record_per_step_with_the_batch_figures(tiny_dir, eager):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_dir("llama")), max_model_len=64) as llm:
        core = llm.engine_core.engine_core
        recorder = Recorder()
        core.step_observers.append(recorder)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10, 11, 12]}], params,
                     use_tqdm=False)  # fmt: skip
        steps_run = core.step_counter
        budget = core.config.scheduler_config.max_num_batched_tokens
        flight = list(core.flight_recorder)
    records = [record for record, _ in recorder.steps]
    assert [r.step_id for r in records] == list(range(1, steps_run + 1)) == recorder.updated
    # Tokens scheduled are what the scheduler output said, split into decodes and prefills.
    for record, (scheduled, new_reqs) in recorder.steps:
        assert record.tokens_scheduled == scheduled == record.num_decode_tokens + record.num_prefill_tokens
        assert record.num_prefill_reqs >= new_reqs and record.token_budget == budget
        assert not record.dummy and record.engine_index == 0 and record.seq == -1  # not yet an event
    assert [r.tokens_scheduled for r in records] == [8, 2, 2, 2]
    first = records[0]
    assert (first.num_prefill_reqs, first.num_prefill_tokens, first.num_decode_tokens) == (2, 8, 0)
    assert all((r.num_decode_reqs, r.num_prefill_reqs) == (2, 0) for r in records[1:])
    # After each step: both requests run until the last step finishes them.
    assert [(r.num_running, r.num_waiting) for r in records] == [(2, 0)] * 3 + [(0, 0)]
    assert all(0.0 <= r.kv_usage <= 1.0 for r in records) and records[-1].kv_usage == 0.0
    assert all(abs(r.schedule_ms + r.execute_ms + r.update_ms - r.duration_ms) < 1e-6 for r in records)
    # The flight recorder, an observer too, kept the same records (as JSON data: the
    # scheduled requests' structs as dicts).
    assert flight == [msgspec.to_builtins(r.figures()) for r in records]
    assert [len(f["scheduled_new_reqs"]) for f in flight] == [2, 0, 0, 0]
