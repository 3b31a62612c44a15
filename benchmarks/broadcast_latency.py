"""Latency of the shared-memory broadcast queue (``engine.executor.shm_broadcast``).

One writer (the engine core's role) broadcasts a pickled ``SchedulerOutput`` — 32 decode
requests the workers already know plus 2 new requests with 300-token prompts — to N reader
processes (the workers' role), N = 1 and 2. It prints, in µs, median and p99 of:

- one-way: from just before ``enqueue`` to the moment each reader's ``dequeue`` returns
  (``time.perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for all processes);
- round trip: ``enqueue`` → each reader dequeues and answers with a pickled
  ``ModelRunnerOutput`` on its own 1-reader response queue → the writer has dequeued every
  answer (what ``collective_rpc`` waits for).

Messages are sent ``--gap-ms`` apart, so the readers are asleep in ``poll`` when a message
comes, as idle workers are while the engine core schedules. The writer spends the gap busy
(as the engine core does, scheduling), not asleep: a CPU that has just woken up runs the
same Python several times slower, which would measure the sleep, not the queue. Pickling
is not in these numbers; its cost is printed on its own line. The "floor" row is the
operating system's part alone: one byte through a FIFO to a process asleep in ``poll``.
On a small VM it dominates, and it is noisy: compare runs, not single numbers.

    .venv/bin/python benchmarks/broadcast_latency.py
    .venv/bin/python benchmarks/broadcast_latency.py --iterations 200 --gap-ms 0
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import select
import statistics
import time

from engine.executor.shm_broadcast import MessageQueue, MessageQueueHandle
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.utils.run_dir import create_run_dir, remove_run_dir

BLOCK_SIZE = 16  # tokens per KV block
ONE_WAY, ROUND_TRIP, QUIT = b"o", b"r", b"q"


def build_scheduler_output(num_cached: int = 32, num_new: int = 2, prompt_len: int = 300) -> SchedulerOutput:
    """A typical decode step with a couple of newcomers: what the engine core broadcasts."""
    new = [
        NewRequestData(
            req_id=f"cmpl-{1000 + i}-0",
            prompt_token_ids=[(7 * t + i) % 32000 for t in range(prompt_len)],
            sampling_params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256),
            eos_token_id=2,
            block_ids=(list(range(100 * i, 100 * i + prompt_len // BLOCK_SIZE + 1)),),
            num_computed_tokens=0,
        )
        for i in range(num_new)
    ]
    cached_ids = [f"cmpl-{i}-0" for i in range(num_cached)]
    cached = CachedRequestData(
        req_ids=cached_ids,
        resumed_from_preemption=[False] * num_cached,
        resumed_req_token_ids=[None] * num_cached,
        # Every 16th decode step crosses into a new block.
        new_block_ids=[([5000 + i],) if i % BLOCK_SIZE == 0 else None for i in range(num_cached)],
        num_computed_tokens=[300 + 17 * i for i in range(num_cached)],
    )
    num_scheduled = {r: 1 for r in cached_ids} | {n.req_id: prompt_len for n in new}
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids={"cmpl-99-0"},
    )


def build_model_runner_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[1234 + i] for i in range(len(req_ids))],
    )


def reader_main(broadcast: MessageQueueHandle, response: MessageQueueHandle, rank: int, reply: bytes) -> None:
    """A worker stand-in: record one-way latencies, answer round trips, report at QUIT."""
    requests = MessageQueue.open_reader(broadcast, rank)
    responses = MessageQueue.open_writer(response)
    latencies_ns: list[int] = []
    while True:
        message = requests.dequeue(timeout=60)
        received_ns = time.perf_counter_ns()
        kind = message[:1]
        if kind == ONE_WAY:
            latencies_ns.append(received_ns - int.from_bytes(message[1:9], "little"))
        elif kind == ROUND_TRIP:
            responses.enqueue(reply, timeout=60)
        else:
            responses.enqueue(pickle.dumps(latencies_ns), timeout=60)
            break
    requests.close()
    responses.close()


def floor_reader_main(fifo_path: str, iterations: int, results) -> None:
    """Wake on each poke of the FIFO; the poke carries its send time (ns)."""
    fd = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    latencies_ns: list[int] = []
    while len(latencies_ns) < iterations:
        poller.poll(60_000)
        woken_ns = time.perf_counter_ns()
        try:
            sent = os.read(fd, 8)
        except BlockingIOError:
            continue
        latencies_ns.append(woken_ns - int.from_bytes(sent, "little"))
    results.send(latencies_ns)


def fifo_floor(iterations: int, gap_s: float) -> tuple[float, float]:
    """Median and p99 (µs) of a bare FIFO wake-up, measured like the one-way latency."""
    run_dir = create_run_dir()
    try:
        fifo_path = str(run_dir / "floor")
        os.mkfifo(fifo_path, 0o600)
        ctx = multiprocessing.get_context("spawn")
        results, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=floor_reader_main, args=(fifo_path, iterations, child_end))
        proc.start()
        fd = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK)
        time.sleep(1.0)  # let the reader start and block (it only counts what it reads)
        for _ in range(iterations):
            os.write(fd, time.perf_counter_ns().to_bytes(8, "little"))
            busy_wait(max(gap_s, 1e-4))  # two pokes must not share one wake-up
        latencies_ns = results.recv()
        proc.join(timeout=30)
        os.close(fd)
        return percentiles_us(latencies_ns)
    finally:
        remove_run_dir(run_dir)


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def percentiles_us(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered) / 1e3, p99 / 1e3


def run(n_readers: int, payload: bytes, reply: bytes, iterations: int, gap_s: float) -> dict[str, tuple]:
    run_dir = create_run_dir()
    try:
        names = [f"Worker_DP0_PP0_TP{r}" for r in range(n_readers)]
        broadcast = MessageQueue.create(
            run_dir, "rpc", n_readers, reader_names=names, writer_name="EngineCore_DP0"
        )
        response_handles = [MessageQueue.create(run_dir, f"out{r}", 1) for r in range(n_readers)]
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=reader_main, args=(broadcast, response_handles[r], r, reply))
            for r in range(n_readers)
        ]
        for p in procs:
            p.start()
        writer = MessageQueue.open_writer(broadcast)
        responses = [MessageQueue.open_reader(h, 0) for h in response_handles]

        # Wait until every reader is up (first round trip), then warm up.
        round_trip_ns: list[int] = []
        for i in range(iterations + 50):
            start = time.perf_counter_ns()
            writer.enqueue(ROUND_TRIP + payload, timeout=60)
            for q in responses:
                q.dequeue(timeout=60)
            if i >= 50:
                round_trip_ns.append(time.perf_counter_ns() - start)
            busy_wait(gap_s)

        for _ in range(iterations):
            writer.enqueue(ONE_WAY + time.perf_counter_ns().to_bytes(8, "little") + payload, timeout=60)
            busy_wait(gap_s)
        writer.enqueue(QUIT, timeout=60)
        one_way_ns = [ns for q in responses for ns in pickle.loads(q.dequeue(timeout=60))]
        for p in procs:
            p.join(timeout=30)
        writer.close()
        for q in responses:
            q.close()
        return {"one-way": percentiles_us(one_way_ns), "round trip": percentiles_us(round_trip_ns)}
    finally:
        remove_run_dir(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000, help="messages per measurement")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="pause between messages, ms")
    args = parser.parse_args()

    scheduler_output = build_scheduler_output()
    payload = pickle.dumps(scheduler_output)
    reply = pickle.dumps(build_model_runner_output(scheduler_output))
    reps = 1000
    t0 = time.perf_counter()
    for _ in range(reps):
        pickle.dumps(scheduler_output)
    t1 = time.perf_counter()
    for _ in range(reps):
        pickle.loads(payload)
    t2 = time.perf_counter()
    print(f"SchedulerOutput: {len(payload)} bytes pickled; ModelRunnerOutput reply: {len(reply)} bytes")
    print(
        f"pickle.dumps {(t1 - t0) / reps * 1e6:.1f} µs, pickle.loads {(t2 - t1) / reps * 1e6:.1f} µs (not below)"
    )
    print(f"{args.iterations} messages, {args.gap_ms} ms apart\n")
    print(f"{'readers':>7}  {'measure':<10}  {'median µs':>9}  {'p99 µs':>8}")
    median, p99 = fifo_floor(args.iterations, args.gap_ms / 1e3)
    print(f"{'-':>7}  {'floor':<10}  {median:>9.1f}  {p99:>8.1f}")
    for n_readers in (1, 2):
        for measure, (median, p99) in run(
            n_readers, payload, reply, args.iterations, args.gap_ms / 1e3
        ).items():
            print(f"{n_readers:>7}  {measure:<10}  {median:>9.1f}  {p99:>8.1f}")


if __name__ == "__main__":
    main()
