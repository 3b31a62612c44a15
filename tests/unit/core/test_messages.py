"""The process-boundary protocols: one typed module per boundary.

- client ↔ engine core: ``engine/core/messages.py``
- engine core ↔ worker: ``engine/executor/messages.py``

Every message round-trips through msgpack; a malformed one is refused with a
``ProtocolError`` that names the boundary (a real check, not an ``assert``); a worker RPC
carries its caller's trace context, so the worker's span is a child of the engine core's
span that made the call; utility calls are matched to their replies by call id.
"""

from __future__ import annotations

import json
import pickle

import msgspec
import numpy as np
import pytest

import tracing
from engine.core import messages as core_msgs
from engine.core.engine_core_proc import _decode_input
from engine.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreSpawnPayload,
    EngineDead,
    EngineHandshake,
    FinishReason,
    SchedulerStats,
    UtilityReply,
    UtilityRequest,
)
from engine.executor import messages as worker_msgs
from engine.executor.messages import WorkerError, WorkerReady, WorkerReply, WorkerRPC, WorkerSpawnPayload
from engine.executor.shm_broadcast import MessageQueueHandle
from engine.outputs import Float32Tensor, ModelRunnerOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.utils.wire import ErrorKind, ProtocolError
from tracing import catalogue
from tracing.propagation import inject_trace_headers

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
HANDLE = MessageQueueHandle("/tmp/run", "rpc", 2, 1 << 20, 4, ("Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"),
                            "EngineCore_DP0")  # fmt: skip


def _scheduler_output() -> SchedulerOutput:
    new = NewRequestData(req_id="r1", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=4),
                         eos_token_id=2, block_ids=([0, 1],), num_computed_tokens=0)  # fmt: skip
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={"r1": 3}, total_num_scheduled_tokens=3,
                           finished_req_ids={"r0"})  # fmt: skip


# ---------------------------------------------------------------- engine core ↔ worker


def _worker_round_trip(message):
    data = worker_msgs.encode(message)
    if isinstance(message, WorkerRPC):
        return worker_msgs.decode_rpc(data)
    if isinstance(message, WorkerSpawnPayload):
        return worker_msgs.decode_spawn_payload(data)
    return worker_msgs.decode_response(data)


def test_worker_messages_round_trip():
    spawn = WorkerSpawnPayload(config_pickle=pickle.dumps({"stand-in": "config"}), rank=1, local_rank=1,
                               rpc_handle=HANDLE, response_handle=HANDLE, trace_headers=TRACE)  # fmt: skip
    assert _worker_round_trip(spawn) == spawn and spawn.config == {"stand-in": "config"}

    # execute_model's SchedulerOutput travels typed; any other call's arguments pickled.
    step = WorkerRPC.make("execute_model", (_scheduler_output(),), None, 0, TRACE)
    assert step.scheduler_output is not None and step.args_pickle == b""
    back = _worker_round_trip(step)
    assert back == step and back.call_args() == ((_scheduler_output(),), {}) and back.output_rank == 0
    generic = WorkerRPC.make("get_comm_stats", (True,), {"x": 1}, None, TRACE)
    assert _worker_round_trip(generic).call_args() == ((True,), {"x": 1})
    assert _worker_round_trip(WorkerRPC.make("load_model")).call_args() == ((), {})

    ready = WorkerReady(role="Worker_DP0_PP0_TP0", rank=0, pid=123, device="auto", dtype="auto")
    assert _worker_round_trip(ready) == ready

    output = ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[9]])
    typed = WorkerReply.success(0, "execute_model", output)
    assert typed.result_pickle == b"" and _worker_round_trip(typed).result() == output
    other = WorkerReply.success(1, "init_device", {"device": "cpu", "dtype": "float32"})
    assert _worker_round_trip(other).result() == {"device": "cpu", "dtype": "float32"}
    assert _worker_round_trip(WorkerReply.success(0, "load_model", None)).result() is None

    try:
        raise ValueError("bad block size")
    except ValueError as e:
        failed = WorkerReply.failure(0, "initialize_from_config", e)
    back = _worker_round_trip(failed)
    assert back == failed and not back.ok
    assert (back.error.type, back.error.message) == ("ValueError", "bad block size")
    assert "Traceback" in back.error.traceback and back.error.flag is None


def test_worker_error_keeps_a_config_errors_flag():
    from engine.config import ConfigError

    error = WorkerError.from_exception(ConfigError.from_message("no CUDA here", flag="--device"))
    assert (error.type, error.flag, error.kind) == ("ConfigError", "--device", ErrorKind.CONFIG)


def test_an_errors_kind_is_decided_by_its_type_where_it_was_raised():
    """The receiver acts on ``kind``, never on the class name: a plain ValueError is the
    caller's bad input, a subclass of it (here a decode error) is a failure."""
    from engine.config import ConfigError

    cases = [
        (ConfigError.from_message("too small", flag="--max-model-len"), ErrorKind.CONFIG),
        (ValueError("bad block size"), ErrorKind.VALUE),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ErrorKind.OTHER),
        (RuntimeError("boom"), ErrorKind.OTHER),
    ]
    for e, kind in cases:
        assert _worker_round_trip(WorkerReply.failure(0, "m", e)).error.kind is kind
        dead = EngineDead.from_exception("=== root cause ===", e, during_startup=True)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(dead), type=EngineDead).kind is kind


@pytest.mark.parametrize(
    "decode, data, says",
    [
        (worker_msgs.decode_rpc, b"\xc1", "engine core ↔ worker"),
        (worker_msgs.decode_rpc, msgspec.msgpack.encode([7, None]), "Expected `str`"),
        (worker_msgs.decode_response, msgspec.msgpack.encode({"type": "shrug", "rank": 0}), "shrug"),
        (worker_msgs.decode_response, pickle.dumps(("ok", 1)), "engine core ↔ worker"),
        (worker_msgs.decode_spawn_payload, msgspec.msgpack.encode({"rank": 0}), "config_pickle"),
    ],
    ids=["not-msgpack", "wrong-field-type", "unknown-tag", "old-pickled-tuple", "missing-field"],
)
def test_malformed_worker_messages_are_refused(decode, data, says):
    with pytest.raises(ProtocolError, match="malformed message") as err:
        decode(data)
    assert says in str(err.value)


def test_worker_refuses_a_spawn_dict_and_non_tuple_arguments():
    with pytest.raises(ProtocolError, match="not encoded WorkerSpawnPayload bytes"):
        worker_msgs.decode_spawn_payload({"rank": 0})  # the old spawn dict
    rpc = WorkerRPC(method="load_model", args_pickle=pickle.dumps(["not", "a", "tuple"]))
    with pytest.raises(ProtocolError, match="arguments are not"):
        rpc.call_args()


def test_a_worker_rpc_carries_the_callers_span():
    tracing.setup_tracing("test", in_memory=True)
    try:
        with tracing.stage(catalogue.ENGINE_CORE_STEP):
            headers = inject_trace_headers()
            rpc = WorkerRPC.make("execute_model", (_scheduler_output(),), None, 0, headers)
        span = tracing.get_finished_spans()[-1]
    finally:
        tracing.shutdown_tracing()
    received = worker_msgs.decode_rpc(worker_msgs.encode(rpc)).trace_headers
    trace_id, span_id = received["traceparent"].split("-")[1:3]
    assert (int(trace_id, 16), int(span_id, 16)) == (span.context.trace_id, span.context.span_id)


# ---------------------------------------------------------------- client ↔ engine core


@pytest.mark.parametrize(
    "message",
    [
        EngineHandshake(kind="HELLO", role="EngineCore_DP0", pid=10),
        EngineHandshake(
            kind="READY",
            role="EngineCore_DP0",
            pid=10,
            num_gpu_blocks=64,
            device="cpu",
            dtype="float32",
            max_model_len=128,
        ),  # fmt: skip
        EngineHandshake(kind="CONNECTED", role="EngineCore_DP1", pid=11, data_parallel_rank=1),
        UtilityRequest.make(3, "get_comm_stats", (True,), TRACE),
        UtilityRequest.make(4, "get_scheduler_stats"),
        UtilityReply.success(3, SchedulerStats(num_running_reqs=2)),
        UtilityReply.failure(4, AttributeError("no such method")),
        EngineDead(
            root_cause="=== root cause ===",
            error_type="ConfigError",
            message="too small",
            flag="--max-model-len",
            during_startup=True,
        ),  # fmt: skip
        EngineCoreSpawnPayload(
            config_pickle=pickle.dumps("cfg"),
            input_addresses=["ipc:///r/in0.sock", "ipc:///r/in1.sock"],
            output_addresses=["ipc:///r/out0.sock", "ipc:///r/out1.sock"],
            trace_headers=TRACE,
        ),  # fmt: skip
        EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(max_tokens=2),
            eos_token_id=None,
            arrival_time=1.0,
            trace_headers=TRACE,
        ),  # fmt: skip
        EngineCoreOutputs(
            outputs=[EngineCoreOutput(request_id="r", new_token_ids=[3], finish_reason=FinishReason.LENGTH)]
        ),  # fmt: skip
        # A pooling request: PoolingParams in place of SamplingParams, and its vector back as
        # float32 bytes with their shape.
        EngineCoreRequest(
            request_id="p",
            prompt_token_ids=[1, 2],
            sampling_params=None,
            pooling_params=PoolingParams(task="embed", use_activation=False, dimensions=4),
            eos_token_id=None,
            arrival_time=1.0,
        ),  # fmt: skip
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(
                    request_id="p",
                    new_token_ids=[],
                    finish_reason=FinishReason.STOP,
                    pooling_output=Float32Tensor.from_numpy(np.arange(4, dtype=np.float32)),
                )
            ]
        ),  # fmt: skip
    ],
    ids=lambda m: type(m).__name__ + (f"-{m.kind}" if isinstance(m, EngineHandshake) else ""),
)
def test_engine_core_messages_round_trip(message):
    back = core_msgs.decode_as(type(message), core_msgs.encode(message))
    assert back == message


def test_utility_payloads_and_the_wire_enum():
    assert UtilityRequest.make(1, "m", (True, 2)).call_args() == (True, 2)
    assert UtilityReply.success(1, SchedulerStats(step_counter=5)).result().step_counter == 5
    assert UtilityReply.failure(1, KeyError("k")).error == "KeyError: 'k'"
    # The frontend reads FinishReason from the messages; the scheduler's name still works.
    from engine.sched.request import FinishReason as SchedFinishReason

    assert SchedFinishReason is FinishReason and str(FinishReason.STOP) == "stop"


def test_malformed_engine_core_messages_are_refused():
    with pytest.raises(ProtocolError, match="client ↔ engine core"):
        core_msgs.decode_as(
            EngineHandshake, core_msgs.encode(EngineHandshake(kind="HELLO", role="x", pid=1))[:-1]
        )
    bad_kind = msgspec.msgpack.encode(["GOODBYE", "EngineCore_DP0", 1])
    with pytest.raises(ProtocolError, match="GOODBYE|Expected"):
        core_msgs.decode_as(EngineHandshake, bad_kind)
    with pytest.raises(ProtocolError, match="not a tuple"):
        UtilityRequest(call_id=1, method="m", args_pickle=pickle.dumps([1])).call_args()
    # The engine core's input thread: the old pickled utility tuple, an unknown or
    # internal request type, a missing frame.
    old = pickle.dumps((0, "get_scheduler_stats", ()))
    with pytest.raises(ProtocolError, match="malformed message"):
        _decode_input([EngineCoreRequestType.UTILITY.value, old])
    for request_type in (b"\x7f", EngineCoreRequestType.EXECUTOR_FAILED.value):
        with pytest.raises(ProtocolError, match="request type"):
            _decode_input([request_type, b""])
    with pytest.raises(ProtocolError, match="1 frames"):
        _decode_input([EngineCoreRequestType.ADD.value])
    abort = core_msgs.encode(core_msgs.AbortRequests(request_ids=["a", "b"], trace_headers=TRACE))
    request_type, message = _decode_input([EngineCoreRequestType.ABORT.value, abort])
    assert (request_type, message.request_ids, message.trace_headers) == (
        EngineCoreRequestType.ABORT,
        ["a", "b"],
        TRACE,
    )
    with pytest.raises(ProtocolError, match="malformed message"):  # the old bare list of ids
        _decode_input([EngineCoreRequestType.ABORT.value, msgspec.msgpack.encode(["a", "b"])])
    # A request stamped with another client's index than the socket it came in on: its
    # outputs would go to the wrong API server.
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                eos_token_id=None, arrival_time=0.0, client_index=0)  # fmt: skip
    frames = [EngineCoreRequestType.ADD.value, core_msgs.encode(request)]
    assert _decode_input(frames, client_index=0)[1].request_id == "r"
    with pytest.raises(ProtocolError, match="stamped client_index 0 came in on client 1's socket"):
        _decode_input(frames, client_index=1)


def test_utility_replies_resolve_their_own_future_by_call_id():
    """Two calls in flight, answered out of order: each future gets its own answer; an answer
    to no pending call, or a frame with an unknown tag, is a protocol error."""
    import itertools
    from collections import deque

    from engine.core.messages import TAG_UTILITY
    from engine.frontend.core_client import SyncMPClient

    client = object.__new__(SyncMPClient)  # no engine process: only the matching logic
    client.utility_futures, client.call_ids, client.pending = {}, itertools.count(), deque()
    client.client_index = 1  # the reply goes to the caller's output socket
    first, body1 = client._utility_request("get_scheduler_stats", ())
    second, body2 = client._utility_request("get_comm_stats", (True,))
    req1, req2 = (core_msgs.decode_as(UtilityRequest, b) for b in (body1, body2))
    assert (req1.method, req2.method, req2.call_args()) == ("get_scheduler_stats", "get_comm_stats", (True,))
    assert (req1.client_index, req2.client_index) == (1, 1)
    client._dispatch((TAG_UTILITY, [core_msgs.encode(UtilityReply.failure(req2.call_id, KeyError("x")))]))
    client._dispatch((TAG_UTILITY, [core_msgs.encode(UtilityReply.success(req1.call_id, {"steps": 3}))]))
    assert first.result() == {"steps": 3}
    with pytest.raises(RuntimeError, match="engine utility 'get_comm_stats' failed: KeyError"):
        second.result()
    assert client.utility_futures == {}
    with pytest.raises(ProtocolError, match="not pending"):
        client._dispatch((TAG_UTILITY, [core_msgs.encode(UtilityReply.success(req1.call_id, None))]))
    with pytest.raises(ProtocolError, match="tagged b'Z'"):
        client._dispatch((b"Z", [b""]))


# ---------------------------------------------------------------- through the process tree


@pytest.mark.slow
def test_worker_spans_are_children_of_the_engine_cores_rpc_span_and_bad_input_kills_clearly(tmp_path):
    """In the real tree (engine core and worker in their own processes): the worker's span
    for an RPC made during KV-cache sizing is a child of the engine core's
    ``engine_core.initialize_kv_cache`` (not of the spawn-time span); utility calls come
    back matched by id; a malformed message to the engine core kills it with a root cause
    that names the protocol error."""
    from engine import LLM
    from engine.utils.processes import EngineDeadError

    trace_file = tmp_path / "spans.jsonl"
    llm = LLM(max_model_len=128, trace_file=str(trace_file))
    try:
        client = llm.engine_core
        stats = client.call_utility("get_scheduler_stats")
        assert isinstance(stats, SchedulerStats) and not client.utility_futures
        with pytest.raises(RuntimeError, match="engine utility 'no_such_method' failed: AttributeError"):
            client.call_utility("no_such_method")
        spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
        by_name = {}
        for s in spans:
            by_name.setdefault(s["name"], []).append(s)
        (kv,) = by_name[catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE]
        for name in (catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY, catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL):
            (worker_span,) = by_name[name]
            assert worker_span["resource"]["glassbox.role"] == "Worker_DP0_PP0_TP0"
            assert kv["resource"]["glassbox.role"] == "EngineCore_DP0"
            assert (
                worker_span["parent_span_id"] == kv["span_id"] and worker_span["trace_id"] == kv["trace_id"]
            )
        # A message the engine core cannot read: it stops, and says why.
        client._run(client._send(EngineCoreRequestType.UTILITY, b"\x93garbage"))
        with pytest.raises(EngineDeadError) as err:
            client.call_utility("get_scheduler_stats")
        assert "ProtocolError: malformed message on the client ↔ engine core boundary" in err.value.root_cause
        assert "EngineCore_DP0" in err.value.root_cause
    finally:
        llm.shutdown()
        tracing.shutdown_tracing()
    assert not llm.run_dir.exists()
