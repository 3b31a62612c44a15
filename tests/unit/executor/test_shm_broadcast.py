"""Tests of ``engine.executor.shm_broadcast.MessageQueue``: order, wrap-around, large
messages, deadlines that name who is late, idle CPU, close and clean-up, and real reader
processes opening a pickled handle."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time

import pytest

from engine.executor.shm_broadcast import (
    MessageQueue,
    MessageQueueClosed,
    MessageQueueHandle,
    MessageQueueTimeout,
)
from tracing.waits import WaitCancelled

WORKERS = ["Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]


def _messages(count: int, max_len: int) -> list[bytes]:
    """Distinct payloads of varied lengths (0 included), each tagged with its index."""
    return [i.to_bytes(4, "little") + os.urandom((i * 37) % max_len) for i in range(count)]


def _read_all(reader: MessageQueue, count: int, out: list[bytes]) -> None:
    for _ in range(count):
        out.append(reader.dequeue(timeout=10))


def _echo_worker(request_handle: MessageQueueHandle, response_handle: MessageQueueHandle, rank: int) -> None:
    """A reader process: echo every broadcast message back, prefixed with its rank."""
    requests = MessageQueue.open_reader(request_handle, rank)
    responses = MessageQueue.open_writer(response_handle)
    try:
        while True:
            try:
                message = requests.dequeue(timeout=10)
            except MessageQueueClosed:
                return
            responses.enqueue(bytes([rank]) + message, timeout=10)
    finally:
        requests.close()
        responses.close()


@pytest.mark.timeout(60)
def test_reader_processes_receive_every_message_in_order(tmp_path):
    # Two spawned reader processes; the ring (4 chunks of 256 bytes) wraps many times and
    # some messages span several chunks. Each process echoes on its own 1-reader queue.
    request_handle = MessageQueue.create(
        tmp_path,
        "rpc",
        2,
        max_chunk_bytes=256,
        max_chunks=4,
        reader_names=WORKERS,
        writer_name="EngineCore_DP0",
    )
    response_handles = [MessageQueue.create(tmp_path, f"out{r}", 1, max_chunk_bytes=256) for r in range(2)]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_echo_worker, args=(request_handle, response_handles[r], r)) for r in range(2)
    ]
    for p in procs:
        p.start()
    writer = MessageQueue.open_writer(request_handle)
    responses = [MessageQueue.open_reader(h, 0) for h in response_handles]
    messages = _messages(100, 700)
    for message in messages:
        writer.enqueue(message, timeout=30)  # 30 s: covers the readers' start-up
        for rank in range(2):
            assert responses[rank].dequeue(timeout=30) == bytes([rank]) + message
    writer.close()  # the readers see MessageQueueClosed and exit
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    for q in responses:
        q.close()
    writer.unlink()
    for q in responses:
        q.unlink()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(30)
def test_wrap_around_with_many_readers(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 3, max_chunk_bytes=64, max_chunks=2)
    writer = MessageQueue.open_writer(handle)
    readers = [MessageQueue.open_reader(handle, r) for r in range(3)]
    messages = _messages(500, 60)  # one chunk each: 250 laps of the ring
    received: list[list[bytes]] = [[], [], []]
    threads = [threading.Thread(target=_read_all, args=(readers[r], 500, received[r])) for r in range(3)]
    for t in threads:
        t.start()
    for message in messages:
        writer.enqueue(message, timeout=10)
    for t in threads:
        t.join(timeout=20)
    assert received == [messages] * 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [0, 4096, 5 * 4096 + 123, 40 * 4096])
def test_message_larger_than_a_chunk_arrives_intact(tmp_path, size):
    # 40 chunks stream through a ring of only 3; exact multiples and empty messages too.
    handle = MessageQueue.create(tmp_path, "big", 2, max_chunk_bytes=4096, max_chunks=3)
    writer = MessageQueue.open_writer(handle)
    readers = [MessageQueue.open_reader(handle, r) for r in range(2)]
    messages = [os.urandom(size), b"after"]
    received: list[list[bytes]] = [[], []]
    threads = [threading.Thread(target=_read_all, args=(readers[r], 2, received[r])) for r in range(2)]
    for t in threads:
        t.start()
    for message in messages:
        writer.enqueue(memoryview(message), timeout=10)
    for t in threads:
        t.join(timeout=20)
    assert received == [messages, messages]


@pytest.mark.timeout(30)
def test_slow_reader_makes_enqueue_time_out_naming_it(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 2, max_chunk_bytes=64, max_chunks=2, reader_names=WORKERS)
    writer = MessageQueue.open_writer(
        handle, describe_reader=lambda rank: f"in stage worker.execute_model (rank {rank})"
    )
    fast = MessageQueue.open_reader(handle, 0)
    slow = MessageQueue.open_reader(handle, 1)  # reads nothing until the timeout
    for i in range(2):  # fills the ring
        writer.enqueue(b"step %d" % i, timeout=1)
        assert fast.dequeue(timeout=1) == b"step %d" % i
    start = time.monotonic()
    with pytest.raises(MessageQueueTimeout) as info:
        writer.enqueue(b"step 2", timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2
    message = str(info.value)
    assert "Worker_DP0_PP0_TP1 (in stage worker.execute_model (rank 1))" in message
    assert "Worker_DP0_PP0_TP0" not in message  # it has read everything
    assert info.value.waiting_for == ("Worker_DP0_PP0_TP1",)
    assert isinstance(info.value, TimeoutError)
    # The timed-out message was not published; once the slow reader catches up, a retry is.
    with pytest.raises(MessageQueueTimeout):
        fast.dequeue(timeout=0.05)
    assert [slow.dequeue(timeout=1) for _ in range(2)] == [b"step 0", b"step 1"]
    writer.enqueue(b"step 2", timeout=1)
    assert fast.dequeue(timeout=1) == slow.dequeue(timeout=1) == b"step 2"


@pytest.mark.timeout(30)
def test_dequeue_timeout_names_the_writer(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 2, reader_names=WORKERS, writer_name="EngineCore_DP0")
    MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(
        handle, 1, describe_writer=lambda _: "in stage engine_core.step for 3.0 s"
    )
    start = time.monotonic()
    with pytest.raises(MessageQueueTimeout) as info:
        reader.dequeue(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    assert "EngineCore_DP0 (in stage engine_core.step for 3.0 s)" in str(info.value)
    assert "Worker_DP0_PP0_TP1" in str(info.value)
    assert info.value.waiting_for == ("EngineCore_DP0",)


@pytest.mark.timeout(30)
def test_default_deadline_comes_from_the_environment(tmp_path, monkeypatch):
    handle = MessageQueue.create(tmp_path, "rpc", 1)
    reader = MessageQueue.open_reader(handle, 0)
    monkeypatch.setenv("GLASSBOX_MQ_TIMEOUT_S", "0.2")
    start = time.monotonic()
    with pytest.raises(MessageQueueTimeout, match=r"timed out after 0\.2 s"):
        reader.dequeue()
    assert time.monotonic() - start < 2
    monkeypatch.setenv("GLASSBOX_MQ_TIMEOUT_S", "forever")
    with pytest.raises(ValueError, match="GLASSBOX_MQ_TIMEOUT_S"):
        reader.dequeue()


@pytest.mark.timeout(30)
def test_reader_timing_out_mid_message_gets_the_whole_message_later(tmp_path):
    # A one-chunk ring and two readers: reader 0 gets chunk 1 of 3, then waits for reader 1
    # (which has not read yet) and times out holding part of the message.
    handle = MessageQueue.create(tmp_path, "big", 2, max_chunk_bytes=100, max_chunks=1)
    writer = MessageQueue.open_writer(handle)
    readers = [MessageQueue.open_reader(handle, r) for r in range(2)]
    message = os.urandom(250)
    sender = threading.Thread(target=writer.enqueue, args=(message, 10))
    sender.start()
    with pytest.raises(MessageQueueTimeout, match="the rest of a message"):
        readers[0].dequeue(timeout=0.2)
    late: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(readers[1], 1, late))
    thread.start()
    assert readers[0].dequeue(timeout=10) == message
    thread.join(timeout=10)
    sender.join(timeout=10)
    assert late == [message]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("with_cancel", [False, True])
def test_blocked_reader_does_not_burn_cpu(tmp_path, with_cancel):
    handle = MessageQueue.create(tmp_path, "rpc", 1)
    writer = MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(handle, 0)
    cancel = threading.Event() if with_cancel else None
    result: dict[str, float | bytes] = {}

    def wait() -> None:
        cpu, wall = time.thread_time(), time.monotonic()
        with pytest.raises(MessageQueueTimeout):
            reader.dequeue(timeout=0.5, cancel=cancel)
        result["cpu_s"], result["wall_s"] = time.thread_time() - cpu, time.monotonic() - wall
        result["message"] = reader.dequeue(timeout=5, cancel=cancel)
        result["woken_after_s"] = time.monotonic() - result.pop("sent_at")

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.8)  # the first dequeue has timed out; the second is blocked
    result["sent_at"] = time.monotonic()
    writer.enqueue(b"wake up", timeout=1)
    thread.join(timeout=10)
    assert result["wall_s"] >= 0.5
    assert result["cpu_s"] < 0.05  # < 10% of one core over 0.5 s of waiting
    assert result["message"] == b"wake up"
    # Woken by the writer's poke: without it the wait would last its full 5 s (or, with
    # cancel, up to one 50 ms slice).
    assert result["woken_after_s"] < 0.5


@pytest.mark.timeout(30)
def test_close_wakes_a_blocked_reader_after_it_read_everything(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 2, writer_name="EngineCore_DP0")
    writer = MessageQueue.open_writer(handle)
    readers = [MessageQueue.open_reader(handle, r) for r in range(2)]
    writer.enqueue(b"last step", timeout=1)
    assert readers[0].dequeue(timeout=1) == b"last step"
    outcome: dict[str, object] = {}

    def wait() -> None:
        start = time.monotonic()
        try:
            readers[0].dequeue(timeout=20)
        except MessageQueueClosed as e:
            outcome["error"], outcome["after_s"] = e, time.monotonic() - start

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    writer.close()
    thread.join(timeout=5)
    assert "EngineCore_DP0" in str(outcome["error"])
    assert outcome["after_s"] < 1.0  # woken by close, not by the 20 s deadline
    # Reader 1 still gets what was published before close, then the close.
    assert readers[1].dequeue(timeout=1) == b"last step"
    with pytest.raises(MessageQueueClosed):
        readers[1].dequeue(timeout=1)
    with pytest.raises(MessageQueueClosed):
        writer.enqueue(b"too late")


@pytest.mark.timeout(30)
def test_cancel_stops_a_blocked_dequeue(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 1)
    MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(handle, 0)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(WaitCancelled):
        reader.dequeue(timeout=20, cancel=cancel)
    assert time.monotonic() - start < 1.0


@pytest.mark.timeout(30)
def test_a_message_published_before_the_cancel_is_returned_not_cancelled(tmp_path):
    # A worker answers (its error says "a setting was refused") and exits; the supervisor sees
    # the exit and sets the cancel, all while the engine core's reader sleeps. On waking, the
    # answer must win: the exit alone would turn a one-line config error into "engine died".
    handle = MessageQueue.create(tmp_path, "r0", 1)
    writer = MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(handle, 0)
    cancel = threading.Event()
    sleeps = []

    class PublishAndCancelWhileAsleep:
        def __init__(self, poller):
            self.poller = poller

        def poll(self, timeout_ms):
            if not sleeps:
                writer.enqueue(b"the answer", timeout=1)
                cancel.set()
            sleeps.append(timeout_ms)
            return self.poller.poll(0)

    reader._poller = PublishAndCancelWhileAsleep(reader._poller)
    assert reader.dequeue(timeout=5, cancel=cancel) == b"the answer"
    assert len(sleeps) == 1, "it slept once, and the published message was then read"
    with pytest.raises(WaitCancelled):  # nothing published: the cancel still stops the wait
        reader.dequeue(timeout=5, cancel=cancel)


@pytest.mark.timeout(30)
def test_close_and_unlink_leave_no_file(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 2, max_chunk_bytes=4096, max_chunks=4)
    assert sorted(os.listdir(tmp_path)) == ["rpc.mq", "rpc.r0", "rpc.r1", "rpc.w"]
    writer = MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(handle, 0)
    writer.enqueue(b"x", timeout=1)
    assert writer.positions() == (1, [0, 0])  # live telemetry's lag gauge
    writer.close()
    # Shutdown closes the queue while the telemetry thread may still ask (CI caught a
    # traceback from a released memoryview in the shutdown log): no positions, no error.
    assert writer.positions() is None
    reader.close()
    writer.close()  # idempotent
    writer.unlink()
    writer.unlink()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        MessageQueue.open_reader(handle, 1)


def test_handle_is_picklable_and_small(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 2, reader_names=WORKERS, writer_name="EngineCore_DP0")
    data = pickle.dumps(handle)
    assert pickle.loads(data) == handle
    assert len(data) < 1024
    assert handle.reader_names == tuple(WORKERS)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="queue name"):
        MessageQueue.create(tmp_path, "a/b", 1)
    with pytest.raises(ValueError, match="queue name"):
        MessageQueue.create(tmp_path, "x" * 17, 1)
    with pytest.raises(ValueError, match="n_readers"):
        MessageQueue.create(tmp_path, "rpc", 0)
    with pytest.raises(ValueError, match="reader_names"):
        MessageQueue.create(tmp_path, "rpc", 2, reader_names=["only_one"])
    handle = MessageQueue.create(tmp_path, "rpc", 2)
    with pytest.raises(FileExistsError):
        MessageQueue.create(tmp_path, "rpc", 2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        MessageQueue.open_reader(handle, 2)
    writer = MessageQueue.open_writer(handle)
    with pytest.raises(RuntimeError, match="writer's end"):
        writer.dequeue(timeout=0.1)


@pytest.mark.timeout(30)
def test_late_reader_gets_everything_and_a_reopened_reader_goes_on(tmp_path):
    handle = MessageQueue.create(tmp_path, "rpc", 1, max_chunks=4)
    writer = MessageQueue.open_writer(handle)
    for i in range(3):
        writer.enqueue(b"m%d" % i, timeout=1)
    reader = MessageQueue.open_reader(handle, 0)  # opened after the writer published
    assert reader.dequeue(timeout=1) == b"m0"
    reader.close()
    reader = MessageQueue.open_reader(handle, 0)
    assert [reader.dequeue(timeout=1) for _ in range(2)] == [b"m1", b"m2"]


@pytest.mark.timeout(30)
def test_writer_timing_out_mid_message_closes_the_queue(tmp_path):
    # Chunk 1 of 3 is published, then reader 1 never frees the only slot: the rest of the
    # message cannot follow, so the readers must not wait for it.
    handle = MessageQueue.create(tmp_path, "big", 2, max_chunk_bytes=100, max_chunks=1, reader_names=WORKERS)
    writer = MessageQueue.open_writer(handle)
    reader = MessageQueue.open_reader(handle, 0)
    MessageQueue.open_reader(handle, 1)
    with pytest.raises(MessageQueueTimeout, match="Worker_DP0_PP0_TP1"):
        writer.enqueue(os.urandom(250), timeout=0.2)
    with pytest.raises(MessageQueueClosed):
        reader.dequeue(timeout=5)
    with pytest.raises(MessageQueueClosed):
        writer.enqueue(b"next", timeout=1)
