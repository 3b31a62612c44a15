"""The scheduler's side of structured outputs: WAITING_FOR_FSM, bitmask rows, grammar advance.

Pure scheduler logic, so the grammar is a fake (``ScriptedGrammar``: it accepts the tokens it
is told to, ends on EOS) and its compile a ``Future`` the test completes by hand; the real
llguidance grammars are tested in ``tests/unit/core/test_structured_output_manager.py``.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
from test_scheduler import EOS, TOKEN, create_request, create_scheduler, step

from engine.sampling_params import StructuredOutputsParams
from engine.sched.request import FinishReason, Request, RequestStatus


class ScriptedGrammar:
    """Accepts every token but ``bad``; terminated once EOS is accepted."""

    def __init__(self, bad: int | None = None) -> None:
        self.bad = bad
        self.accepted: list[int] = []
        self.terminated = False
        self._error: str | None = None

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if token == self.bad:
                self._error = f"token {token} refused"
                return False
            self.accepted.append(token)
            self.terminated = self.terminated or token == EOS
        return True

    def fill_bitmask(self, bitmask, index, remaining_tokens):
        bitmask[index].fill(-1)

    def is_terminated(self) -> bool:
        return self.terminated

    def error(self) -> str | None:
        return self._error


class FakeManager:
    """The calls the scheduler makes: ``should_advance``, ``grammar_bitmask`` and, for its
    stats, ``compile_time_histogram``."""

    def __init__(self) -> None:
        self.bitmask_calls: list[list[str]] = []

    def should_advance(self, request: Request) -> bool:
        return request.use_structured_output

    def compile_time_histogram(self):
        return [0, 1], 0.25

    def grammar_bitmask(self, requests, ids):
        self.bitmask_calls.append(list(ids))
        return np.full((len(ids), 4), -1, dtype=np.int32)


def structured_request(request_id: str, prompt: int = 8, max_tokens: int = 16) -> tuple[Request, Future]:
    request = create_request(
        request_id, prompt, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )
    compile_future: Future = Future()
    request.structured_output_request.grammar = compile_future
    return request, compile_future


def test_a_request_waits_for_its_grammar_while_others_run():
    scheduler = create_scheduler()
    scheduler.structured_output_manager = FakeManager()
    waiting, compiled = structured_request("so")
    plain = create_request("plain", 8)
    assert waiting.status == RequestStatus.WAITING_FOR_FSM
    scheduler.add_request(waiting)
    scheduler.add_request(plain)

    # The grammar compiles: the scheduler passes over "so" and schedules the one behind it.
    output, _, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["plain"]
    assert waiting.status == RequestStatus.WAITING_FOR_FSM
    assert scheduler.num_waiting_for_fsm() == 1
    stats = scheduler.make_stats()  # what /metrics shows: one waits for its grammar; the compiles so far
    assert stats.num_waiting_for_fsm == 1 and stats.grammar_compile_counts == [0, 1]
    assert list(scheduler.waiting) == [waiting]  # it kept its place

    grammar = ScriptedGrammar()
    compiled.set_result(grammar)
    output, _, _ = step(scheduler)
    assert output.num_scheduled_tokens["so"] == 8
    assert waiting.status == RequestStatus.RUNNING
    # Its prompt is complete after this step, so it samples under its grammar: one bitmask row.
    assert output.structured_output_request_ids == ["so"]
    scheduler.get_grammar_bitmask(output)
    assert output.grammar_bitmask == np.full((1, 4), -1, dtype=np.int32).tobytes()
    assert grammar.accepted == [TOKEN]


def test_a_prefill_chunk_that_samples_nothing_gets_no_bitmask_row():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    scheduler.structured_output_manager = FakeManager()
    request, compiled = structured_request("so", prompt=20)
    compiled.set_result(ScriptedGrammar())
    scheduler.add_request(request)
    output, _, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"so": 8}
    assert output.structured_output_request_ids == []


def test_a_grammar_that_failed_to_compile_finishes_the_request_with_an_error():
    scheduler = create_scheduler()
    scheduler.structured_output_manager = FakeManager()
    request, compiled = structured_request("so")
    scheduler.add_request(request)
    compiled.set_exception(ValueError("unsatisfiable schema"))
    output, outputs, _ = step(scheduler)
    assert output.num_scheduled_tokens == {}
    assert outputs["so"].finish_reason == FinishReason.ERROR
    assert "unsatisfiable schema" in outputs["so"].stop_reason
    assert not scheduler.has_unfinished_requests()


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error():
    scheduler = create_scheduler()
    scheduler.structured_output_manager = FakeManager()
    request, compiled = structured_request("so")
    compiled.set_result(ScriptedGrammar(bad=TOKEN))
    scheduler.add_request(request)
    _, outputs, _ = step(scheduler)
    assert outputs["so"].finish_reason == FinishReason.ERROR
    assert "refused" in outputs["so"].stop_reason


def test_an_eos_the_grammar_refuses_is_an_error_not_a_stop():
    # The output may not end here: EOS stops the request in check_stop, but the grammar
    # refuses it, so the client learns its reply is not a whole document.
    scheduler = create_scheduler()
    scheduler.structured_output_manager = FakeManager()
    request, compiled = structured_request("so")
    compiled.set_result(ScriptedGrammar(bad=EOS))
    scheduler.add_request(request)
    _, outputs, _ = step(scheduler, lambda r: EOS)
    assert outputs["so"].finish_reason == FinishReason.ERROR


def test_eos_terminates_the_grammar_and_stops_the_request():
    scheduler = create_scheduler()
    scheduler.structured_output_manager = FakeManager()
    request, compiled = structured_request("so")
    grammar = ScriptedGrammar()
    compiled.set_result(grammar)
    scheduler.add_request(request)
    step(scheduler)
    _, outputs, _ = step(scheduler, lambda r: EOS)
    assert outputs["so"].finish_reason == FinishReason.STOP
    assert grammar.is_terminated() and grammar.accepted == [TOKEN, EOS]


def test_a_preempted_request_keeps_its_grammar_state():
    # 4 usable blocks of 8 tokens; two requests of 7 + 16 tokens need 3 each: as they grow,
    # the lower-priority one ("so") is preempted, recomputed, and finishes later.
    scheduler = create_scheduler(num_blocks=5, max_model_len=32, policy="priority")
    scheduler.structured_output_manager = FakeManager()
    so, compiled = structured_request("so", prompt=7, max_tokens=16)
    grammar = ScriptedGrammar()
    compiled.set_result(grammar)
    scheduler.add_request(so)
    scheduler.add_request(create_request("big", 7, max_tokens=16, priority=-1))
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert so.num_preemptions >= 1
    # The grammar was advanced by each output token exactly once, preemption or not (vLLM
    # keeps the grammar on the request; recomputing the KV samples nothing new).
    assert grammar.accepted == so.output_token_ids
    assert len(grammar.accepted) == 16
