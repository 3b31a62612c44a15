"""``DPLoadBalancer``, the routing every multiprocess client does over its data-parallel
engines: the lowest ``waiting * 4 + running``, the requests sent since the coordinator's last
publish counted as waiting, a pinned ``data_parallel_rank`` honoured, aborts sent to the
engine that has the request, finished requests forgotten. Pure bookkeeping: no process,
no socket (no coordinator subscribed).
"""

from __future__ import annotations

from engine.core.coordinator_messages import score
from engine.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine.frontend.dp_load_balancer import DPLoadBalancer
from engine.sampling_params import SamplingParams


def _request(request_id: str, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[1], sampling_params=SamplingParams(),
                             eos_token_id=None, arrival_time=0.0, data_parallel_rank=rank)  # fmt: skip


def test_client_picks_the_lowest_score_counting_what_it_sent_since_the_last_publish():
    assert score(num_waiting=1, num_running=0) == 4 and score(0, 3) == 3
    client = DPLoadBalancer(2)  # the routing state every multiprocess client holds
    # Nothing published yet: a burst alternates, each send counted as waiting.
    assert [client.get_core_engine_for_request(_request(f"r{i}")) for i in range(4)] == [0, 1, 0, 1]
    # The coordinator says engine 0 has 2 waiting, engine 1 runs 5: 8 vs 5 → engine 1, then
    # engine 1 counts 4 more (9) → engine 0.
    client.engine_loads, client.sent_since_loads = [(2, 0), (0, 5)], [0, 0]
    assert client.get_core_engine_for_request(_request("a")) == 1
    assert client.get_core_engine_for_request(_request("b")) == 0
    assert client.get_core_engine_for_request(_request("pinned", rank=1)) == 1
    assert client.requests_sent == [3, 4]
    # Aborts go to the engine that has the request; an unknown id goes to every engine.
    assert client.engines_for_abort(["a", "b", "pinned", "nobody"]) == {1: ["a", "pinned", "nobody"],
                                                                         0: ["b", "nobody"]}  # fmt: skip
    assert "a" not in client.request_engine


# ---------------------------------------------------------------------- slow: the real tree


def test_a_finished_request_is_no_engine_s_any_more():
    balancer = DPLoadBalancer(2)
    for name in ("done", "stopped", "running"):
        balancer.get_core_engine_for_request(_request(name))
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="done", new_token_ids=[3], finish_reason=FinishReason.LENGTH)],
        finished_requests={"stopped"},
    )
    balancer.forget_finished(outputs)
    assert set(balancer.request_engine) == {"running"}
