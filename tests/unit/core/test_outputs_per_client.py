"""Outputs per client, and scheduler stats per engine.

- ``OutputRouter`` (engine core): each step's outputs go to the client whose requests they
  are; every client gets the scheduler stats, stamped with the engine's index — on its own
  outputs, on their own when its last ones are old, and always after the engine's last step.
- ``EngineStatsTable`` (client): the latest stats per engine, filled from the outputs as
  they are received; stats that come alone are not handed on as outputs.
- ``/metrics`` renders the table with an ``engine`` label per DP rank and asks the engine
  nothing (no utility call per scrape).
- One real ``EngineCoreProc`` with two clients (client 1 is two bare sockets in this
  process): each receives exactly the outputs of its own requests and the reply to its own
  utility call; only client 0, which launched the engine, gets HELLO / READY.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import types
from collections import deque

import pytest
import zmq

from engine.core.engine_core_proc import OutputRouter
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    TAG_OUTPUTS,
    TAG_UTILITY,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshake,
    SchedulerStats,
    UtilityReply,
    UtilityRequest,
    decode_as,
    encode,
)
from engine.frontend.engine_stats import EngineStatsTable
from engine.sampling_params import SamplingParams
from engine.utils.wire import ProtocolError


def _out(*request_ids: str, stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=r, new_token_ids=[5]) for r in request_ids],
        scheduler_stats=stats,
    )


# ---------------------------------------------------------------------------- engine side


def test_router_sends_each_client_its_own_outputs_and_everyone_the_stats():
    now = [100.0]
    router = OutputRouter(num_clients=3, engine_index=1, stats_interval_s=0.1, clock=lambda: now[0])
    stats = SchedulerStats(num_running_reqs=3, step_counter=1)
    # The scheduler puts the stats on one entry (client 0's): every client gets them.
    routed = dict(router.route({0: _out("a", stats=stats), 2: _out("c1", "c2")}, going_idle=False))
    assert sorted(routed) == [0, 1, 2]
    assert [o.request_id for o in routed[0].outputs] == ["a"]
    assert routed[1].outputs == []  # client 1: the stats alone
    assert [o.request_id for o in routed[2].outputs] == ["c1", "c2"]
    assert all(eco.scheduler_stats is stats and eco.engine_index == 1 for eco in routed.values())

    # 50 ms later: client 1 has no outputs and got stats recently, so nothing goes to it.
    now[0] += 0.05
    stats2 = SchedulerStats(num_running_reqs=3, step_counter=2)
    routed = dict(router.route({2: _out("c1", stats=stats2)}, going_idle=False))
    assert sorted(routed) == [2]
    assert routed[2].scheduler_stats is stats2
    # 100 ms after its last stats, client 1 and client 0 get them again, alone.
    now[0] += 0.06
    stats3 = SchedulerStats(num_running_reqs=1, step_counter=3)
    routed = dict(router.route({2: _out("c2", stats=stats3)}, going_idle=False))
    assert sorted(routed) == [0, 1, 2] and routed[0].outputs == [] and routed[1].scheduler_stats is stats3
    # The last step before going idle: every client gets the final stats, at once.
    now[0] += 0.001
    final = SchedulerStats(num_running_reqs=0, step_counter=4)
    routed = dict(router.route({2: _out(stats=final)}, going_idle=True))
    assert sorted(routed) == [0, 1, 2] and all(eco.scheduler_stats is final for eco in routed.values())


def test_router_without_stats_sends_only_outputs():
    router = OutputRouter(num_clients=2, engine_index=0)
    routed = router.route({1: _out("b")}, going_idle=True)  # log_stats off: no stats at all
    assert [(i, [o.request_id for o in eco.outputs]) for i, eco in routed] == [(1, ["b"])]


def test_a_request_or_utility_call_from_another_client_is_a_protocol_error():
    """The one client-index check, where the message arrives: a request or utility call
    stamped with another client than its socket's is refused, naming both; so every request
    the scheduler holds, and every output the router gets, is one of the engine's clients."""
    from engine.core.engine_core_proc import _decode_input

    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(),
                                eos_token_id=None, arrival_time=0.0, client_index=2)  # fmt: skip
    with pytest.raises(ProtocolError, match="ADD stamped client_index 2 came in on client 1's socket"):
        _decode_input([EngineCoreRequestType.ADD.value, encode(request)], client_index=1)
    utility = encode(UtilityRequest.make(1, "m", client_index=5))
    with pytest.raises(ProtocolError, match="UTILITY stamped client_index 5 came in on client 0's socket"):
        _decode_input([EngineCoreRequestType.UTILITY.value, utility], client_index=0)


# ---------------------------------------------------------------------------- client side


def test_stats_table_keeps_the_latest_per_engine():
    table = EngineStatsTable([0, 1])
    assert table.snapshot() == {0: SchedulerStats(), 1: SchedulerStats()}  # before any step
    assert table.seconds_since_update(0) is None
    table.update_from_outputs(
        EngineCoreOutputs(engine_index=1, scheduler_stats=SchedulerStats(num_waiting_reqs=4))
    )
    table.update_from_outputs(EngineCoreOutputs(engine_index=0))  # no stats: nothing changes
    table.update(1, SchedulerStats(num_waiting_reqs=2, kv_cache_usage=0.25))
    snap = table.snapshot()
    assert list(snap) == [0, 1] and snap[0] == SchedulerStats()
    assert (snap[1].num_waiting_reqs, snap[1].kv_cache_usage) == (2, 0.25)
    assert table.seconds_since_update(1) >= 0 and len(table) == 2


def test_client_fills_the_table_from_received_outputs():
    """The receive path (``_dispatch``): stats go into the table; outputs with requests in
    them are handed on, stats that came alone are not."""
    from engine.frontend.core_client import SyncMPClient
    from engine.frontend.dp_load_balancer import DPLoadBalancer

    client = object.__new__(SyncMPClient)  # no engine process: only the receive logic
    client.pending, client.stats_table = deque(), EngineStatsTable([0])
    client.load_balancer = DPLoadBalancer(1)  # which engine has each request (data parallelism)
    busy = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5)
    client._dispatch((TAG_OUTPUTS, [encode(_out("r", stats=busy))]))
    assert client.stats_table.snapshot()[0] == busy
    assert [o.request_id for o in client.pending.popleft().outputs] == ["r"]
    idle = SchedulerStats(num_running_reqs=0, kv_cache_usage=0.0, step_counter=9)
    client._dispatch((TAG_OUTPUTS, [encode(EngineCoreOutputs(scheduler_stats=idle))]))
    assert client.stats_table.snapshot()[0] == idle and not client.pending


def test_metrics_read_the_table_with_an_engine_label_and_make_no_utility_call():
    from fastapi.testclient import TestClient

    from engine.engine_args import EngineArgs
    from engine.entrypoints.openai.app import build_app
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.tokenizer import get_tokenizer

    model_config = EngineArgs().create_engine_config().model_config
    calls: list[str] = []

    async def call_utility_async(method, *args):
        calls.append(method)
        raise AssertionError("a scrape must not call the engine")

    async def get_scheduler_stats():
        calls.append("get_scheduler_stats")
        raise AssertionError("a scrape must not call the engine")

    table = EngineStatsTable([0, 1])
    engine = types.SimpleNamespace(model_config=model_config, tokenizer=get_tokenizer(model_config.tokenizer),
                                   dead_error=None, stats_table=table, get_scheduler_stats=get_scheduler_stats,
                                   engine_core=types.SimpleNamespace(call_utility_async=call_utility_async))  # fmt: skip
    engine.get_default_sampling_params = lambda: AsyncLLM.get_default_sampling_params(engine)
    client = TestClient(build_app(engine, served_model_name="m"))

    def sample(text: str, name: str, engine_index: int) -> float:
        (line,) = [
            ln for ln in text.splitlines() if ln.startswith(name + "{") and f'engine="{engine_index}"' in ln
        ]
        assert 'model_name="m"' in line
        return float(line.rsplit(" ", 1)[1])

    text = client.get("/metrics").text
    assert (
        sample(text, "vllm:num_requests_running", 0) == 0
        and sample(text, "vllm:num_requests_running", 1) == 0
    )
    table.update(
        1, SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, prefix_cache_hits=7)
    )
    text = client.get("/metrics").text
    assert (
        sample(text, "vllm:num_requests_running", 1) == 2
        and sample(text, "vllm:num_requests_waiting", 1) == 1
    )
    assert (
        sample(text, "vllm:kv_cache_usage_perc", 1) == 0.5
        and sample(text, "vllm:kv_cache_usage_perc", 0) == 0
    )
    assert sample(text, "vllm:prefix_cache_hits_total", 1) == 7
    # One HELP/TYPE header per metric, one series per engine.
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert len(re.findall(r"^vllm:num_requests_running\{", text, re.M)) == 2
    assert calls == []


# ---------------------------------------------------------------------------- one engine, two clients


@pytest.mark.slow
def test_two_clients_of_one_engine_core_each_get_only_their_own_outputs(default_model_dir):
    """Client 0 is a ``SyncMPClient`` (it launches the engine core for two clients); client 1
    is a bare ROUTER and a bare PULL socket bound at its addresses in this process. Each
    client's requests go in through its own input socket, stamped with its index."""
    from engine.distributed import topology
    from engine.engine_args import EngineArgs
    from engine.frontend.core_client import SyncMPClient
    from engine.frontend.engine_launcher import client_input_address, client_output_address
    from engine.utils import run_dir as run_dirs

    config = EngineArgs(model=str(default_model_dir), max_model_len=128).create_engine_config(
        usage_context="llm"
    )
    run_dir = run_dirs.create_run_dir()
    ctx = zmq.Context()
    second = ctx.socket(zmq.PULL)
    second.setsockopt(zmq.LINGER, 0)
    second.bind(client_output_address(run_dir, 1))
    second_in = ctx.socket(zmq.ROUTER)
    second_in.setsockopt(zmq.LINGER, 0)
    second_in.bind(client_input_address(run_dir, 1))
    client = None
    try:
        run_dirs.write_manifest(run_dir, **run_dirs.plan_tree(topology.plan(config, multiprocess=True)))
        client = SyncMPClient(config, run_dir, client_index=0, num_clients=2)
        ids = itertools.count()

        def request(client_index: int, max_tokens: int) -> EngineCoreRequest:
            return EngineCoreRequest(request_id=f"c{client_index}-{next(ids)}", prompt_token_ids=[7, 8, 9, 10],
                                     sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True),
                                     eos_token_id=None, arrival_time=time.time(), client_index=client_index)  # fmt: skip

        mine = [request(0, n) for n in (3, 6)]
        theirs = [request(1, n) for n in (2, 5, 8)]
        for req in mine:
            client.add_request(req)
        # Client 1: the engine's DEALER says CONNECTED on client 1's ROUTER; then client 1
        # sends its requests and a utility call through it, as an attached client would.
        assert second_in.poll(30_000), "the engine core never connected to client 1's input socket"
        identity, body = second_in.recv_multipart()
        assert decode_as(EngineHandshake, body).kind == "CONNECTED"
        for req in theirs:
            second_in.send_multipart([identity, EngineCoreRequestType.ADD.value, encode(req)])
        utility = encode(UtilityRequest.make(77, "get_kv_cache_info", client_index=1))
        second_in.send_multipart([identity, EngineCoreRequestType.UTILITY.value, utility])

        # Client 0: its outputs only (a reply to client 1's utility call here would be a
        # ProtocolError: no such call is pending on this client).
        tokens0: dict[str, int] = {}
        finished0: set[str] = set()
        while finished0 != {r.request_id for r in mine}:
            for out in client.get_output().outputs:
                tokens0[out.request_id] = tokens0.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    finished0.add(out.request_id)
        assert tokens0 == {r.request_id: r.sampling_params.max_tokens for r in mine}

        # Client 1: its own outputs, its utility reply, and stats until the engine is idle
        # (the final update after the last step); no handshake (client 0 launched it).
        handshakes, tokens1, finished1, replies, last_stats = [], {}, set(), [], None
        deadline = time.monotonic() + 60
        while not (finished1 == {r.request_id for r in theirs} and replies and last_stats
                   and last_stats.num_running_reqs == 0 and last_stats.num_waiting_reqs == 0):  # fmt: skip
            assert time.monotonic() < deadline, (finished1, replies, last_stats)
            if not second.poll(1000):
                continue
            tag, body = second.recv_multipart()
            assert tag != ENGINE_CORE_DEAD
            if tag == TAG_HANDSHAKE:
                handshakes.append(decode_as(EngineHandshake, body).kind)
            elif tag == TAG_UTILITY:
                replies.append(decode_as(UtilityReply, body))
            else:
                assert tag == TAG_OUTPUTS
                eco = decode_as(EngineCoreOutputs, body)
                assert eco.engine_index == 0 and eco.scheduler_stats is not None
                last_stats = eco.scheduler_stats
                for out in eco.outputs:
                    tokens1[out.request_id] = tokens1.get(out.request_id, 0) + len(out.new_token_ids)
                    if out.finished:
                        finished1.add(out.request_id)
        assert handshakes == []
        assert tokens1 == {r.request_id: r.sampling_params.max_tokens for r in theirs}
        assert [r.call_id for r in replies] == [77] and replies[0].result()["num_blocks"] > 0

        # Client 0's table reaches the idle figures too, from the outputs alone.
        deadline = time.monotonic() + 30
        while (stats := client.stats_table.snapshot()[0]).num_running_reqs or stats.num_waiting_reqs:
            client._dispatch(client._run(asyncio.wait_for(client._recv(), deadline - time.monotonic())))
            assert time.monotonic() < deadline
        assert stats.kv_cache_usage == 0 and stats.step_counter > 0
        assert not client.pending  # stats alone were not handed on as outputs
    finally:
        if client is not None:
            client.shutdown()
        second.close(linger=0)
        second_in.close(linger=0)
        ctx.term()
        run_dirs.remove_run_dir(run_dir)
