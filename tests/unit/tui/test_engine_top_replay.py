"""engine-top on a recording, step by step: ``--replay FILE --at STEP`` and the n / p keys.

Read from recorded data: the telemetry lesson 6 ships
(``tutorials/data/06-scheduler/two-requests.telemetry``, made by
``scripts/record_lesson_data.py scheduler``: ``--max-num-batched-tokens 16 --step-delay-ms
200``, request A with a 40-token prompt, then B with 24 tokens once A's first token is out,
4 tokens each). Its steps are the scheduler's arithmetic, so they are asserted exactly.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tracing.telemetry.collector import recording_steps, replay_at
from tui import views
from tui.app import App

REPO = Path(__file__).resolve().parents[3]
RECORDING = REPO / "tutorials" / "data" / "06-scheduler" / "two-requests.telemetry"
# (decode tokens, prefill tokens) of each step: A's prompt in chunks of 16, 16, 8; A decodes
# first while B (arrived during step 4) takes what is left, 15 then 9; B decodes alone; the
# last step schedules nothing and hands B's finished id to the worker.
SPLIT = [(0, 16), (0, 16), (0, 8), (1, 0), (1, 15), (1, 9), (1, 0), (1, 0), (1, 0), (0, 0)]


def _last(state):
    return state.steps[0][-1]


def render(renderable, width: int = 140) -> str:
    console = Console(record=True, width=width, color_system=None, force_terminal=False, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_recording_has_the_steps_the_scheduler_arithmetic_gives():
    assert recording_steps(RECORDING) == list(range(1, 11))
    end = replay_at(RECORDING, 10)
    assert [(s.num_decode_tokens, s.num_prefill_tokens) for s in end.steps[0]] == SPLIT
    assert all(s.token_budget == 16 and s.step_delay_ms == 200.0 for s in end.steps[0])


def test_at_a_step_the_state_stops_there_with_that_steps_scheduler_output():
    state = replay_at(RECORDING, 5)
    assert state.replay_step == 5 and state.replay_steps == list(range(1, 11))
    step = _last(state)
    assert step.step_id == 5 and max(state.steps[0], key=lambda s: s.step_id) is step
    (new,) = step.scheduled_new_reqs  # B, first scheduled: 15 of its 24 prompt tokens
    (cached,) = step.scheduled_cached_reqs  # A, decoding: one token after its 41
    assert (new.num_scheduled_tokens, new.num_computed_tokens, new.num_new_blocks, new.prefill) == (
        15,
        0,
        1,
        True,
    )
    assert (cached.num_scheduled_tokens, cached.num_computed_tokens, cached.prefill) == (1, 41, False)
    assert state.requests[new.req_id].state == "scheduled"  # the event step 5 published with its record
    first = replay_at(RECORDING, 1)
    assert [s.step_id for s in first.steps[0]] == [1] and first.now < state.now


def test_the_empty_last_step_hands_the_finished_id_to_the_worker():
    state = replay_at(RECORDING, 10)
    step = _last(state)
    assert step.tokens_scheduled == 0 and not step.scheduled_new_reqs and not step.scheduled_cached_reqs
    b = replay_at(RECORDING, 5).steps[0][-1].scheduled_new_reqs[0].req_id
    assert step.finished_req_ids == [b]
    text = render(views.panel("scheduled", state, views.ViewOptions()))
    assert "nothing scheduled (0+0)" in text and b in text


def test_a_step_past_the_end_is_refused_with_the_steps_there_are():
    with pytest.raises(ValueError, match="has steps 1 to 10; no step 11"):
        replay_at(RECORDING, 11)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="140", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "tui", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_at_prints_the_state_as_of_that_step():
    out = _cli("--replay", str(RECORDING), "--at", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["replay_step"] == 4 and data["steps"]["0"][-1]["step_id"] == 4
    assert data["steps"]["0"][-1]["scheduled_cached_reqs"][0]["num_scheduled_tokens"] == 1
    text = _cli("--replay", str(RECORDING), "--at", "4", "--once")
    assert text.returncode == 0, text.stderr
    assert "REPLAY at step 4 of 1..10" in text.stdout and "step 4: SchedulerOutput" in text.stdout
    bad = _cli("--replay", str(RECORDING), "--at", "99", "--once")
    assert bad.returncode == 1 and "no step 99" in bad.stderr
    assert _cli("--at", "3", "--once").returncode == 2  # --at needs --replay


def test_keys_step_a_replay_forward_and_back():
    app = App(replay=RECORDING, open_replay=lambda path, speed: None)
    app.seek(3)
    assert app.at_step == 3 and _last(app.state).step_id == 3
    app.handle_key("n")
    assert app.at_step == 4
    app.handle_key("right")
    app.handle_key("p")
    app.handle_key("left")
    assert app.at_step == 3 and _last(app.state).step_id == 3
    app.seek(1)
    app.handle_key("p")  # nothing before the first step
    assert app.at_step == 1 and "first step" in (app.opts.notice or "")
    app.poll()  # stepping by hand: the collector's snapshots do not replace the state
    assert _last(app.state).step_id == 1
    app.handle_key("r")
    assert app.at_step is None  # plays on
