"""``EngineCore`` and ``EngineCoreProc`` driven over a fake executor (``fake_executor.py``).

As vLLM's ``tests/v1/engine/test_engine_core.py`` does with a real model, but with no
model: only the workers are fake, and they sample scripted tokens (``default_token``), so
every test knows each token the engine core must hand out. The scheduler, KV cache manager
and output building are the real ones. Small blocks (8 tokens) keep the block arithmetic
readable.

- ``EngineCore``: tokens step by step, finish reasons (length, EOS), aborts free every KV
  block, preemption under a small KV budget still completes every request, an executor error
  is what ``step()`` raises, a step with nothing to do, the ``StepRecord`` each step observer
  gets.
- ``EngineCoreProc`` in this process, with the client's two sockets bound here: the
  handshake, a request in and its outputs out, an abort mid-flight, utility calls, a dead
  worker, shutdown. Every wait has a deadline.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from fake_executor import NUM_BLOCKS, FakeExecutor, default_token

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.engine_core_proc import EngineCoreProc
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    TAG_OUTPUTS,
    TAG_UTILITY,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDead,
    EngineHandshake,
    FinishReason,
    UtilityReply,
    UtilityRequest,
    decode_as,
    encode,
)
from engine.core.step_observer import StepObserver
from engine.engine_args import EngineArgs
from engine.frontend.engine_launcher import client_input_address, client_output_address
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 8
EOS = 2
DEADLINE_S = 60.0  # for every wait on another thread (a loaded machine is slow, never this slow)


def make_config(**overrides) -> EngineConfig:
    """The bundled model's config (only its shape is read: nothing is loaded) with 8-token
    blocks, 64-token requests and a 32-token step budget unless ``overrides`` say otherwise."""
    args = dict(max_model_len=64, block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_num_seqs=8)
    return EngineArgs(**{**args, **overrides}).create_engine_config()


def make_request(request_id: str, prompt_len: int = 6, max_tokens: int = 4, **sampling) -> EngineCoreRequest:
    """A request whose prompt is ``prompt_len`` tokens that no other request id shares."""
    start = 10 + 1000 * (sum(map(ord, request_id)) % 50)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(range(start, start + prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_id=EOS,
        arrival_time=time.time(),
    )


def scripted(request_id: str, num_tokens: int) -> list[int]:
    return [default_token(request_id, position) for position in range(num_tokens)]


@pytest.fixture
def make_engine():
    """``make_engine(**config_overrides)``: an ``EngineCore`` over a ``FakeExecutor``."""
    engines: list[EngineCore] = []

    def make(**overrides) -> EngineCore:
        engines.append(EngineCore(make_config(**overrides), executor_class=FakeExecutor))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def run_to_completion(engine: EngineCore, max_steps: int = 500):
    """Step until nothing is left. Returns (tokens per request, finish reason per request)."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not engine.scheduler.has_requests():
            return tokens, finished
        outputs, _ = engine.step()
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finished[out.request_id] = out.finish_reason
    raise AssertionError(f"requests left after {max_steps} steps: {list(engine.scheduler.requests)}")


def new_tokens(outputs: dict[int, EngineCoreOutputs]) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for eco in outputs.values() for o in eco.outputs}


def assert_every_block_free(engine: EngineCore) -> None:
    manager = engine.scheduler.kv_cache_manager
    assert (
        manager.block_pool.get_num_free_blocks() == engine.kv_cache_config.num_blocks - 1
    )  # all but the null block
    assert manager.usage == 0.0
    assert manager.req_to_blocks == {}


# ---------------------------------------------------------------------------- EngineCore


def test_each_step_hands_out_the_scripted_tokens_until_max_tokens(make_engine):
    engine = make_engine()
    assert engine.kv_cache_config.num_blocks == NUM_BLOCKS  # what the fake worker's budget holds
    engine.add_request(make_request("a", prompt_len=6, max_tokens=3))
    engine.add_request(make_request("b", prompt_len=11, max_tokens=5))
    # Both prompts fit the 32-token budget: one step prefills both and samples a token each.
    outputs, executed = engine.step()
    assert executed and new_tokens(outputs) == {"a": scripted("a", 1), "b": scripted("b", 1)}
    outputs, _ = engine.step()  # then one decode token each
    assert new_tokens(outputs) == {"a": [default_token("a", 1)], "b": [default_token("b", 1)]}
    tokens, finished = run_to_completion(engine)
    assert tokens == {"a": [default_token("a", 2)], "b": [default_token("b", p) for p in (2, 3, 4)]}
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert_every_block_free(engine)


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_end(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(make_request("long", prompt_len=40, max_tokens=2))
    chunks = [new_tokens(engine.step()[0]).get("long", []) for _ in range(3)]  # 16 + 16 + 8 tokens
    assert chunks == [[], [], scripted("long", 1)]
    tokens, finished = run_to_completion(engine)
    assert tokens == {"long": [default_token("long", 1)]} and finished == {"long": FinishReason.LENGTH}


def test_eos_finishes_with_stop_unless_the_request_ignores_it(make_engine):
    engine = make_engine()
    engine.model_executor.eos_at = {"stops": 2, "ignores": 2}
    engine.add_request(make_request("stops", max_tokens=8))
    engine.add_request(make_request("ignores", max_tokens=4, ignore_eos=True))
    tokens, finished = run_to_completion(engine)
    assert tokens["stops"] == [*scripted("stops", 2), EOS]  # the EOS is the last token
    assert tokens["ignores"] == [*scripted("ignores", 2), EOS, default_token("ignores", 3)]
    assert finished == {"stops": FinishReason.STOP, "ignores": FinishReason.LENGTH}
    assert_every_block_free(engine)


def test_abort_frees_every_block_and_tells_the_worker(make_engine):
    engine = make_engine(max_num_seqs=1)  # "waits" cannot run while "runs" does
    engine.add_request(make_request("runs", prompt_len=20, max_tokens=30))
    engine.add_request(make_request("waits", prompt_len=20, max_tokens=30))
    for _ in range(3):
        engine.step()
    manager = engine.scheduler.kv_cache_manager
    assert manager.usage > 0 and list(manager.req_to_blocks) == ["runs"]
    engine.abort_requests(["runs", "waits", "unknown"])  # an unknown id is ignored
    assert_every_block_free(engine)
    # The next step computes nothing: it only hands the finished ids to the worker.
    outputs, executed = engine.step()
    assert not executed and new_tokens(outputs) == {}
    assert engine.model_executor.requests == {}
    assert not engine.scheduler.has_requests()


def test_requests_preempted_when_blocks_run_out_still_get_every_scripted_token(make_engine):
    # 6 blocks, one of them the null block: 40 tokens of KV for three requests that grow to
    # 24 tokens (3 blocks) each, so the scheduler must preempt and recompute.
    engine = make_engine(max_model_len=32, num_gpu_blocks_override=6)
    records = RecordSteps()
    engine.step_observers.append(records)
    for request_id in ("a", "b", "c"):
        engine.add_request(make_request(request_id, prompt_len=8, max_tokens=16))
    tokens, finished = run_to_completion(engine)
    assert sum(r.num_preempted for r in records.records) > 0 and engine.scheduler.num_preemptions > 0
    assert tokens == {request_id: scripted(request_id, 16) for request_id in ("a", "b", "c")}
    assert finished == dict.fromkeys("abc", FinishReason.LENGTH)
    assert_every_block_free(engine)


def test_an_executor_error_is_the_error_step_raises(make_engine):
    engine = make_engine()
    error = RuntimeError("worker 0 failed: CUDA error: an illegal memory access")
    engine.model_executor.fail_at_step, engine.model_executor.error = 2, error
    engine.add_request(make_request("a", max_tokens=8))
    assert new_tokens(engine.step()[0]) == {"a": scripted("a", 1)}
    with pytest.raises(RuntimeError) as raised:
        engine.step()
    assert raised.value is error


def test_a_step_with_no_request_runs_nothing(make_engine):
    engine = make_engine()
    assert engine.step() == ({}, False)
    assert engine.model_executor.num_steps == 0 and engine.step_counter == 0


class RecordSteps(StepObserver):
    """Keeps each step's ``StepRecord``."""

    def __init__(self) -> None:
        self.records = []

    def on_step(self, record, scheduler_output, outputs) -> None:
        self.records.append(record)


def test_the_step_record_counts_each_steps_prefill_and_decode_tokens(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    records = RecordSteps()
    engine.step_observers.append(records)
    engine.add_request(make_request("a", prompt_len=20, max_tokens=2))
    engine.add_request(make_request("b", prompt_len=5, max_tokens=2))
    run_to_completion(engine)
    figures = [
        (r.step_id, r.tokens_scheduled, r.num_prefill_reqs, r.num_prefill_tokens, r.num_chunked_prefills,
         r.num_decode_reqs, r.num_decode_tokens, r.num_running, r.num_waiting)
        for r in records.records
    ]  # fmt: skip
    assert figures == [
        (1, 16, 1, 16, 1, 0, 0, 1, 1),  # 16 of a's 20 prompt tokens; b waits for budget
        (2, 9, 2, 9, 0, 0, 0, 2, 0),  # a's last 4, b's 5: both sample their first token
        (3, 2, 0, 0, 0, 2, 2, 0, 0),  # a decode each: both reach max_tokens
        (4, 0, 0, 0, 0, 0, 0, 0, 0),  # nothing computed: the finished ids go to the worker
    ]
    assert all(r.token_budget == 16 for r in records.records)
    assert records.records[1].kv_usage > 0 and records.records[2].kv_usage == 0.0  # freed as they finish


def test_the_step_record_lists_each_steps_scheduler_output_request_by_request(make_engine):
    engine = make_engine(max_num_batched_tokens=16, step_delay_ms=1)
    records = RecordSteps()
    engine.step_observers.append(records)
    engine.add_request(make_request("a", prompt_len=20, max_tokens=2))
    engine.add_request(make_request("b", prompt_len=5, max_tokens=2))
    run_to_completion(engine)

    def plan(r):
        return ([(q.req_id, q.num_scheduled_tokens, q.num_computed_tokens, q.num_new_blocks, q.prefill)
                 for q in r.scheduled_new_reqs],
                [(q.req_id, q.num_scheduled_tokens, q.num_computed_tokens, q.num_new_blocks, q.prefill, q.resumed)
                 for q in r.scheduled_cached_reqs], r.finished_req_ids)  # fmt: skip

    assert [plan(r) for r in records.records] == [
        ([("a", 16, 0, 2, True)], [], []),  # 16 tokens need two 8-token blocks
        ([("b", 5, 0, 1, True)], [("a", 4, 16, 1, True, False)], []),  # a's last 4 spill into a third block
        ([], [("a", 1, 20, 0, False, False), ("b", 1, 5, 0, False, False)], []),
        ([], [], ["a", "b"]),  # the empty step: it only hands the finished ids to the worker
    ]
    # --step-delay-ms is on every record, apart from the step's own time
    assert all(r.step_delay_ms == 1 for r in records.records)
    assert engine.last_step_delay_ns[1] - engine.last_step_delay_ns[0] >= 1_000_000


def test_a_pooling_request_is_all_prefill_and_finishes_with_its_vector(make_engine):
    engine = make_engine(runner="pooling", max_num_batched_tokens=16)
    records = RecordSteps()
    engine.step_observers.append(records)
    request = make_request("p", prompt_len=20)
    request = msgspec.structs.replace(
        request, sampling_params=None, pooling_params=PoolingParams(task="embed")
    )
    engine.add_request(request)
    outputs = [o for _ in range(3) for eco in engine.step()[0].values() for o in eco.outputs]
    # Two steps: 16 prompt tokens, then the last 4; the second brings the vector and the finish.
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in records.records] == [(16, 0), (4, 0), (0, 0)]
    scheduled = [q for r in records.records for q in r.scheduled_new_reqs + r.scheduled_cached_reqs]
    assert [(q.num_scheduled_tokens, q.prefill, q.pooling) for q in scheduled] == [
        (16, True, True),
        (4, True, True),
    ]
    [out] = outputs
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert out.pooling_output.numpy().tolist() == [float(sum(request.prompt_token_ids)), 20.0]
    assert_every_block_free(engine)


# ---------------------------------------------------------------------------- EngineCoreProc


class EngineCoreProcInThisProcess:
    """An ``EngineCoreProc`` over a ``FakeExecutor``, its busy loop on a thread, and the
    client's two sockets bound here (a ROUTER it sends on, a PULL it receives on), on ipc
    paths in a short directory under /tmp (a socket path has at most 107 bytes)."""

    def __init__(self, config: EngineConfig) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="gbec", dir="/tmp"))
        self.ctx = zmq.Context()
        self.to_engine = self.ctx.socket(zmq.ROUTER)
        self.to_engine.bind(client_input_address(self.run_dir, 0))
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(client_output_address(self.run_dir, 0))
        self.engine = EngineCoreProc(
            config,
            [client_input_address(self.run_dir, 0)],
            [client_output_address(self.run_dir, 0)],
            data_parallel_rank=0,
            run_dir=self.run_dir,
            executor_class=FakeExecutor,
        )
        self.executor: FakeExecutor = self.engine.model_executor
        # The constructor said HELLO, then READY once its core was built (to client 0: us).
        self.handshakes = [self.recv(), self.recv()]
        self.loop_error: BaseException | None = None
        self.busy_loop = threading.Thread(target=self._run_busy_loop, name="busy_loop", daemon=True)
        self.busy_loop.start()
        # The engine's input socket says CONNECTED on ours: now we can address it.
        assert self.to_engine.poll(DEADLINE_S * 1000), "the engine core never connected"
        self.identity, body = self.to_engine.recv_multipart()
        assert decode_as(EngineHandshake, body).kind == "CONNECTED"
        self.call_ids = iter(range(1, 1_000_000))

    def _run_busy_loop(self) -> None:
        try:
            self.engine.run_busy_loop()
        except BaseException as e:  # what ended the loop is the test's to judge
            self.loop_error = e

    def send(self, request_type: EngineCoreRequestType, message) -> None:
        self.to_engine.send_multipart([self.identity, request_type.value, encode(message)])

    def call_utility(self, method: str, *args) -> int:
        call_id = next(self.call_ids)
        self.send(EngineCoreRequestType.UTILITY, UtilityRequest.make(call_id, method, args))
        return call_id

    def recv(self):
        """The next message from the engine core, decoded by its tag."""
        assert self.from_engine.poll(DEADLINE_S * 1000), "nothing from the engine core"
        tag, body = self.from_engine.recv_multipart()
        kind = {TAG_HANDSHAKE: EngineHandshake, TAG_OUTPUTS: EngineCoreOutputs, TAG_UTILITY: UtilityReply,
                ENGINE_CORE_DEAD: EngineDead}[tag]  # fmt: skip
        return decode_as(kind, body)

    def recv_until(self, done) -> tuple[dict[str, list[int]], dict[str, FinishReason], list[UtilityReply]]:
        """Outputs and utility replies until ``done(tokens, finished, replies)``."""
        tokens: dict[str, list[int]] = {}
        finished: dict[str, FinishReason] = {}
        replies: list[UtilityReply] = []
        deadline = time.monotonic() + DEADLINE_S
        while not done(tokens, finished, replies):
            assert time.monotonic() < deadline, (tokens, finished, replies)
            message = self.recv()
            if isinstance(message, UtilityReply):
                replies.append(message)
            else:
                assert isinstance(message, EngineCoreOutputs), message
                for out in message.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        finished[out.request_id] = out.finish_reason
        return tokens, finished, replies

    def busy_loop_ended_by(self) -> BaseException | None:
        """Wait for the busy loop to end by itself; what ended it."""
        self.busy_loop.join(DEADLINE_S)
        assert not self.busy_loop.is_alive(), "the busy loop did not end"
        return self.loop_error

    def end_busy_loop(self) -> BaseException | None:
        """End the busy loop as a headless engine's ends when its head stops (``SystemExit(0)``
        through the input queue; a SIGTERM raises the same on a process's main thread, which a
        test cannot do to another thread); what ended it."""
        if self.busy_loop.is_alive():
            self.engine.input_queue.put((EngineCoreRequestType.HEAD_LOST, SystemExit(0)))
        return self.busy_loop_ended_by()

    def shutdown(self) -> None:
        """What the engine core process does at exit: the busy loop has ended, then
        ``EngineCoreProc.shutdown`` (once)."""
        self.end_busy_loop()
        if not self.executor.shut_down:
            self.engine.shutdown()

    def close(self) -> None:
        try:
            self.shutdown()
        finally:
            self.to_engine.close(linger=0)
            self.from_engine.close(linger=0)
            self.ctx.term()
            shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def proc():
    """``proc(**config_overrides)``: an ``EngineCoreProcInThisProcess``, closed after the test."""
    made: list[EngineCoreProcInThisProcess] = []

    def make(**overrides) -> EngineCoreProcInThisProcess:
        made.append(EngineCoreProcInThisProcess(make_config(**overrides)))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_proc_says_hello_and_ready_then_streams_a_requests_scripted_tokens(proc):
    p = proc()
    hello, ready = p.handshakes
    assert (hello.kind, ready.kind) == ("HELLO", "READY")
    assert (ready.num_gpu_blocks, ready.device, ready.max_model_len) == (NUM_BLOCKS, "fake", 64)
    p.send(EngineCoreRequestType.ADD, make_request("a", max_tokens=5))
    p.send(EngineCoreRequestType.ADD, make_request("b", max_tokens=3))
    tokens, finished, _ = p.recv_until(lambda tokens, finished, replies: len(finished) == 2)
    assert tokens == {"a": scripted("a", 5), "b": scripted("b", 3)}
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_proc_aborts_a_request_mid_flight_and_answers_utility_calls(proc):
    p = proc(max_model_len=512)
    before = p.call_utility("get_kv_cache_info")
    _, _, (reply,) = p.recv_until(lambda tokens, finished, replies: replies)
    assert reply.call_id == before
    assert reply.result() == {"num_blocks": NUM_BLOCKS, "num_free_blocks": NUM_BLOCKS - 1}
    # The worker pauses in the request's second step while the abort and two calls go in;
    # the request has ~500 steps left, far more than the abort needs to arrive.
    p.executor.pause_at_step = 2
    p.send(EngineCoreRequestType.ADD, make_request("long", prompt_len=8, max_tokens=500))
    assert p.executor.paused.wait(DEADLINE_S)
    p.send(EngineCoreRequestType.ABORT, AbortRequests(request_ids=["long"]))
    after_abort = p.call_utility("get_kv_cache_info")
    unknown = p.call_utility("no_such_method")
    # The abort and both calls must be in the engine's input queue before the step resumes
    # (else, on a loaded machine, the 500 fast steps can all finish before the input thread
    # has read them).
    deadline = time.monotonic() + DEADLINE_S
    while p.engine.input_queue.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert p.engine.input_queue.qsize() >= 3
    p.executor.resume.set()
    tokens, finished, replies = p.recv_until(lambda tokens, finished, replies: len(replies) == 2)
    # The request stopped where the abort found it: a prefix of its script, never finished.
    assert 2 <= len(tokens["long"]) < 500 and tokens["long"] == scripted("long", len(tokens["long"]))
    assert finished == {}
    assert [r.call_id for r in replies] == [after_abort, unknown]
    assert replies[0].result()["num_free_blocks"] == NUM_BLOCKS - 1  # every block back
    assert not replies[1].ok and "no_such_method" in replies[1].error


def test_a_worker_that_dies_while_the_engine_is_idle_ends_the_busy_loop_with_its_error(proc):
    p = proc()
    p.send(EngineCoreRequestType.ADD, make_request("a", max_tokens=2))
    p.recv_until(lambda tokens, finished, replies: "a" in finished)  # then the engine is idle
    error = RuntimeError("Worker_DP0_PP0_TP0 died (SIGKILL)")
    p.executor.die(error)
    assert p.busy_loop_ended_by() is error


def test_an_execute_model_error_ends_the_busy_loop_with_it(proc):
    p = proc()
    p.executor.fail_at_step = 1
    p.send(EngineCoreRequestType.ADD, make_request("a", max_tokens=2))
    assert p.busy_loop_ended_by() is p.executor.error


def test_proc_shutdown_stops_the_worker_and_the_engines_threads(proc):
    p = proc()
    p.send(EngineCoreRequestType.ADD, make_request("a", max_tokens=2))
    tokens, _, _ = p.recv_until(lambda tokens, finished, replies: "a" in finished)
    assert tokens == {"a": scripted("a", 2)}
    p.shutdown()
    assert isinstance(p.loop_error, SystemExit) and p.executor.shut_down
    p.engine.input_thread.join(DEADLINE_S)
    assert not p.engine.input_thread.is_alive() and not p.engine.output_thread.is_alive()


def test_telemetry_reports_which_blocks_each_request_holds_and_the_free_cached_ones(make_engine):
    # engine-top's KV panel reads these: block ids per request, and free blocks that still
    # hold a prefix (hits for later requests) apart from empty ones.
    from tracing.telemetry import events

    engine = make_engine()
    prompt = list(range(500, 520))  # 20 tokens: 2 full blocks of 8, and 4 more
    engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=prompt, eos_token_id=EOS,
                                         sampling_params=SamplingParams(max_tokens=4), arrival_time=time.time()))  # fmt: skip
    engine.step()
    (progress,) = engine.telemetry_requests()
    assert progress.block_ids == engine.scheduler.kv_cache_manager.get_block_ids("a")[0]
    assert progress.num_blocks == len(progress.block_ids) == 3
    run_to_completion(engine)
    gauges = engine.telemetry_gauges()
    # a's 2 full prompt blocks stay cached once freed; its last, partly filled block is empty
    assert gauges[events.GAUGE_KV_CACHED] == 2
    assert gauges[events.GAUGE_KV_FREE] == gauges[events.GAUGE_KV_TOTAL] == NUM_BLOCKS - 1

    engine.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=prompt[:16] + [7, 8, 9], eos_token_id=EOS,
                                         sampling_params=SamplingParams(max_tokens=3), arrival_time=time.time()))  # fmt: skip
    engine.step()
    # b took the 2 cached blocks back (its prefix hit): they are in use, no longer free-cached
    assert engine.telemetry_gauges()[events.GAUGE_KV_CACHED] == 0
    run_to_completion(engine)
    gauges = engine.telemetry_gauges()
    assert gauges[events.GAUGE_KV_CACHED] == 2
    assert gauges[events.GAUGE_PREFIX_HIT_RATE] == 16 / (20 + 19)
