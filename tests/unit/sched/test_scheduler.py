"""The V1 scheduler, driven step by step with hand-made model-runner outputs.

In the style of vLLM's ``tests/v1/core/test_scheduler.py``: small helpers build requests
and a scheduler, each test calls ``schedule()`` and ``update_from_output()`` and asserts on
the ``SchedulerOutput`` — pure logic, no model, no torch. Small blocks (8 tokens, the
smallest ``--block-size`` but 1) keep the block arithmetic readable.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.kv_cache.kv_cache_utils import get_request_block_hasher
from engine.outputs import LogprobsLists, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.request import FinishReason, Request, RequestStatus
from engine.sched.request_queue import create_request_queue
from engine.sched.scheduler import Scheduler

BLOCK_SIZE = 8
EOS = 2
TOKEN = 100  # what the fake model samples unless told otherwise

_arrival = iter(range(1, 1_000_000))


def create_scheduler(
    num_blocks: int = 101,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_size=4, num_layers=1)
    return Scheduler(scheduler_config, cache_config, KVCacheConfig(num_blocks=num_blocks, spec=spec))


def create_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 16,
    priority: int = 0,
    client_index: int = 0,
    **sampling_kwargs,
) -> Request:
    """``prompt`` is token ids, or a length (then tokens 10, 11, … offset by the id's hash)."""
    if isinstance(prompt, int):
        start = 10 + 1000 * (sum(map(ord, request_id)) % 50)
        prompt = list(range(start, start + prompt))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling_kwargs),
        eos_token_id=EOS,
        arrival_time=float(next(_arrival)),
        priority=priority,
        client_index=client_index,
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )


def model_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sample: Callable[[Request], int | list[int]] = lambda request: TOKEN,
) -> ModelRunnerOutput:
    """What a model runner would return: a sampled token for each request whose prompt
    (and earlier outputs) are all computed after this step, nothing for a partial chunk."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        else:
            token = sample(request)
            sampled.append(token if isinstance(token, list) else [token])
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
    )


def step(
    scheduler: Scheduler, sample: Callable[[Request], int | list[int]] = lambda request: TOKEN
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput], dict[int, EngineCoreOutputs]]:
    """One engine step. Returns the plan, the per-request outputs, and the raw outputs."""
    scheduler_output = scheduler.schedule()
    engine_core_outputs = scheduler.update_from_output(
        scheduler_output, model_runner_output(scheduler, scheduler_output, sample)
    )
    by_id = {o.request_id: o for eco in engine_core_outputs.values() for o in eco.outputs}
    return scheduler_output, by_id, engine_core_outputs


def scripted(script: dict[str, list[int]]) -> Callable[[Request], int]:
    """A sampler that emits each request's scripted tokens in order, then TOKEN."""

    def sample(request: Request) -> int:
        remaining = script.get(request.request_id)
        return remaining.pop(0) if remaining else TOKEN

    return sample


def run_to_completion(scheduler: Scheduler, sample=lambda request: TOKEN, max_steps: int = 200):
    """Step until nothing is left; return every request's final output."""
    finals: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finals, tokens
        _, outputs, _ = step(scheduler, sample)
        for req_id, out in outputs.items():
            tokens.setdefault(req_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[req_id] = out
    raise AssertionError(
        f"not finished after {max_steps} steps: {scheduler.running + list(scheduler.waiting)}"
    )


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    assert scheduler.requests == {}


# ---------------------------------------------------------------- one token budget


def test_running_decodes_get_the_budget_before_waiting_prefills():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(create_request("a", 8))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 8}

    scheduler.add_request(create_request("b", 20))
    out, outputs, _ = step(scheduler)
    # a's decode (1 token) first; the new prompt gets the 9 tokens left.
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.total_num_scheduled_tokens == 10
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert list(outputs) == ["a"]  # b's prompt is not done: no token for it yet


def test_chunked_prefill_spans_steps_and_samples_only_at_the_end():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    request = create_request("r", 20)
    scheduler.add_request(request)

    out, outputs, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r": 8}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.scheduled_new_reqs[0].block_ids == ([1],)
    assert request.num_computed_tokens == 8 and outputs == {}

    out, outputs, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r": 8}
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.scheduled_cached_reqs.new_block_ids == [([2],)]
    assert request.num_computed_tokens == 16 and outputs == {}

    out, outputs, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_cached_reqs.new_block_ids == [([3],)]
    assert outputs["r"].new_token_ids == [TOKEN]
    assert request.num_computed_tokens == 20 and request.num_output_tokens == 1

    out, _, _ = step(scheduler)  # now a plain decode, within the last block
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [None]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = create_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    scheduler.add_request(create_request("a", 4))
    step(scheduler)
    scheduler.add_request(create_request("b", 16))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1}  # b needs 16, only 15 are left: it waits
    assert scheduler.get_request_counts() == (1, 1)

    chunked = create_scheduler(max_num_batched_tokens=16, max_model_len=16)
    chunked.add_request(create_request("a", 4))
    step(chunked)
    chunked.add_request(create_request("b", 16))
    out, _, _ = step(chunked)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = create_scheduler(long_prefill_token_threshold=4)
    scheduler.add_request(create_request("long", 10))
    scheduler.add_request(create_request("short", 3))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 4, "short": 3}
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 4, "short": 1}
    out, outputs, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"long": 2, "short": 1}
    assert outputs["long"].new_token_ids == [TOKEN]


def test_max_num_seqs_limits_running_requests():
    scheduler = create_scheduler(max_num_seqs=2)
    for i, max_tokens in enumerate([1, 5, 5]):
        scheduler.add_request(create_request(f"r{i}", 4, max_tokens=max_tokens))
    out, outputs, _ = step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert scheduler.get_request_counts() == (1, 1)  # r0 finished after one token
    assert outputs["r0"].finish_reason == FinishReason.LENGTH

    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r1": 1, "r2": 4}
    assert out.finished_req_ids == {"r0"}  # the workers learn r0 is gone
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


# ---------------------------------------------------------------- prefix caching


def test_shared_prefix_hits_and_is_counted():
    scheduler = create_scheduler()
    a = create_request("a", list(range(10, 30)))  # 20 tokens: 2 full blocks
    scheduler.add_request(a)
    out, _, _ = step(scheduler)
    a_blocks = out.scheduled_new_reqs[0].block_ids[0]

    b = create_request("b", [*range(10, 26), 70, 71, 72])  # shares the first 16 tokens
    scheduler.add_request(b)
    out, outputs, eco = step(scheduler)
    new_b = out.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens == 16
    assert new_b.block_ids[0][:2] == a_blocks[:2]
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert outputs["b"].num_cached_tokens == 16
    stats = eco[0].scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 19, 16)


def test_a_waiting_request_retried_for_lack_of_blocks_is_counted_once():
    # 4 usable blocks of 8 tokens: "a" (24 tokens, then decodes into a 4th block) leaves
    # "b" (16 tokens, 2 blocks) waiting for several steps; b's prefix-cache lookup runs on
    # each of them, but vLLM counts a lookup at admission only: 24 + 16 queries, not more.
    scheduler = create_scheduler(num_blocks=5)
    scheduler.add_request(create_request("a", 24, max_tokens=4))
    scheduler.add_request(create_request("b", 16, max_tokens=1))
    admitted_at = None
    for step_index in range(1, 10):
        out, _, eco = step(scheduler)
        if out.scheduled_new_reqs and out.scheduled_new_reqs[0].req_id == "b":
            admitted_at = step_index
            break
    assert admitted_at is not None and admitted_at > 2  # b was looked up and refused first
    stats = eco[0].scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24 + 16, 0)


def test_a_preempted_request_readmitted_is_not_counted_as_a_new_query():
    # vLLM's vllm:prefix_cache_queries counts requests admitted for the first time; the
    # re-admission of a preempted request (whose hit is its own recomputed prefix) goes to
    # PrefixCacheStats.preempted_* instead.
    scheduler = create_scheduler(num_blocks=5)
    scheduler.add_request(create_request("a", 15, max_tokens=10))
    scheduler.add_request(create_request("b", 15, max_tokens=10))
    manager = scheduler.kv_cache_manager
    queries = preempted_requests = 0
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        scheduler_output = scheduler.schedule()
        stats = manager.prefix_cache_stats
        queries += stats.queries
        preempted_requests += stats.preempted_requests
        scheduler.update_from_output(scheduler_output, model_runner_output(scheduler, scheduler_output))
    assert scheduler.num_preemptions > 0
    assert preempted_requests == scheduler.num_preemptions
    assert queries == scheduler.prefix_cache_queries == 15 + 15


def test_block_aligned_prompt_sent_twice_recomputes_its_last_block():
    scheduler = create_scheduler()
    prompt = list(range(10, 26))  # exactly 2 blocks
    scheduler.add_request(create_request("first", prompt, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(create_request("second", prompt, max_tokens=1))
    out, outputs, eco = step(scheduler)
    # A full hit would leave nothing to compute and no logits to sample from: the last
    # token is recomputed, so the last block is too.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"second": 8}
    assert outputs["second"].new_token_ids == [TOKEN]
    assert eco[0].scheduler_stats.prefix_cache_hits == 8
    assert_all_blocks_free(scheduler)


def test_prefix_caching_off_never_hits():
    scheduler = create_scheduler(enable_prefix_caching=False)
    prompt = list(range(10, 22))
    scheduler.add_request(create_request("first", prompt, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(create_request("second", prompt, max_tokens=1))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"second": 12}


# ---------------------------------------------------------------- preemption


def test_fcfs_preempts_the_last_running_request_and_admits_nothing_that_step():
    scheduler = create_scheduler(num_blocks=5)  # 4 usable blocks of 8 tokens
    scheduler.add_request(create_request("a", 16, max_tokens=3))
    scheduler.add_request(create_request("b", 16))
    out, _, _ = step(scheduler)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2],)
    assert out.scheduled_new_reqs[1].block_ids == ([3, 4],)  # the cache is now full

    c = create_request("c", 2)
    scheduler.add_request(c)
    # a's 17th token needs a third block: b (the last running) is preempted to make room.
    out, _, eco = step(scheduler)
    b = scheduler.requests["b"]
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [([4],)]  # b's tail block, reused
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # b went back to the front of the queue; nothing is admitted in a preempting step.
    assert c.status == RequestStatus.WAITING
    assert list(scheduler.waiting) == [b, c]
    assert eco[0].scheduler_stats.num_preemptions == 1

    out, _, _ = step(scheduler)  # b (17 tokens, 1 block still cached) does not fit yet
    assert out.num_scheduled_tokens == {"a": 1}
    assert scheduler.requests == {"b": b, "c": c}  # a finished (max_tokens=3)

    # b resumes: its first block is still cached; its tail block was evicted (reused by a).
    out, _, _ = step(scheduler)
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"]
    assert cached.resumed_from_preemption == [True]
    assert cached.resumed_req_token_ids == [b.prompt_token_ids + [TOKEN]]
    assert cached.new_block_ids == [([3, 4, 2],)]  # the whole table, replacing the old one
    assert cached.num_computed_tokens == [8]
    assert out.num_scheduled_tokens["b"] == 17 - 8
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert b.num_preemptions == 1

    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_outputs_carry_the_engine_events_queued_scheduled_preempted_in_order():
    """What the frontend turns into time in queue, prefill and decode time (vLLM's events)."""
    scheduler = create_scheduler(num_blocks=5)  # 4 usable blocks of 8 tokens
    scheduler.add_request(create_request("a", 16, max_tokens=3))
    scheduler.add_request(create_request("b", 16, max_tokens=4))
    events: dict[str, list] = {"a": [], "b": []}
    while scheduler.has_requests():
        _, by_id, _ = step(scheduler)
        for request_id, output in by_id.items():
            events[request_id].extend(output.events or ())
    kinds = {r: [e.type for e in evs] for r, evs in events.items()}
    Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED
    assert kinds["a"] == [Q, S]
    assert kinds["b"] == [Q, S, P, S]  # preempted when a needed a third block, then resumed
    assert all(x.timestamp <= y.timestamp for evs in events.values() for x, y in zip(evs, evs[1:]))
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize(("policy", "victim", "survivor"), [("fcfs", "a", "b"), ("priority", "b", "a")])
def test_preemption_victim_by_policy(policy, victim, survivor):
    scheduler = create_scheduler(num_blocks=5, policy=policy)
    scheduler.add_request(create_request("b", 12, priority=1))  # less important, came first
    step(scheduler)
    scheduler.add_request(create_request("a", 16, priority=0))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"b": 1, "a": 16}  # the cache is now full

    # b's decode fits in its blocks and is scheduled first; a's needs a new block.
    out, _, _ = step(scheduler)
    # FCFS: a is the last running request, so a preempts itself.
    # PRIORITY: b has the lowest priority; its scheduled token is taken back.
    assert out.preempted_req_ids == {victim}
    assert out.num_scheduled_tokens == {survivor: 1}
    assert out.total_num_scheduled_tokens == 1
    assert scheduler.requests[victim].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.running] == [survivor]

    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_priority_victim_already_scheduled_gives_back_its_token_and_nobody_is_admitted():
    scheduler = create_scheduler(num_blocks=6, policy="priority")  # 5 usable blocks
    scheduler.add_request(create_request("low", 12, priority=1))
    step(scheduler)
    scheduler.add_request(create_request("a", 16))
    scheduler.add_request(create_request("d", 4))
    out, _, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"low": 1, "a": 16, "d": 4}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0

    scheduler.add_request(create_request("urgent", 2, priority=-5))
    scheduler.max_num_scheduled_tokens = 2  # tight: a and d both fit only if low's token comes back
    out, _, _ = step(scheduler)
    # low's decode fit and was scheduled first; then a needed a block, and low (lowest
    # priority) was preempted: its token is taken back and d, after a, still runs.
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"a": 1, "d": 1}
    assert [r.request_id for r in scheduler.running] == ["a", "d"]
    # urgent would fit in the block left free, but a step that preempted admits nobody.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    assert scheduler.requests["urgent"].status == RequestStatus.WAITING

    scheduler.max_num_scheduled_tokens = 64
    out, _, _ = step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["urgent"]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_priority_policy_admits_lowest_value_first():
    scheduler = create_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(create_request("late_low", 4, priority=5))
    scheduler.add_request(create_request("urgent", 4, priority=-1))
    scheduler.add_request(create_request("normal", 4, priority=0))
    order = []
    while scheduler.has_unfinished_requests():
        out, _, _ = step(scheduler, lambda request: EOS)
        order += [r.req_id for r in out.scheduled_new_reqs]
    assert order == ["urgent", "normal", "late_low"]


def test_waiting_queues_keep_their_order():
    a, b, c = (create_request(name, 3, priority=p) for name, p in [("a", 2), ("b", 1), ("c", 2)])
    fcfs = create_request_queue("fcfs")
    for request in (a, b, c):
        fcfs.add_request(request)
    assert fcfs.pop_request() is a and fcfs.pop_request() is b
    fcfs.prepend_requests([a, b])  # back at the front, in their order
    assert list(fcfs) == [a, b, c] and fcfs.peek_request() is a
    fcfs.remove_requests([b])
    assert list(fcfs) == [a, c] and len(fcfs) == 2

    priority = create_request_queue("priority")
    for request in (a, b, c):
        priority.add_request(request)
    assert list(priority) == [b, a, c]  # lowest value first, then earliest arrival
    assert priority.peek_request() is b and priority.pop_request() is b
    priority.prepend_request(b)  # a push: b is first again because of its priority
    priority.remove_request(a)
    assert list(priority) == [b, c]
    with pytest.raises(ValueError):
        create_request_queue("lifo")


def test_request_larger_than_the_whole_cache_raises_instead_of_hanging():
    scheduler = create_scheduler(num_blocks=3, max_num_batched_tokens=8)  # 2 blocks = 16 tokens
    scheduler.add_request(create_request("huge", 24))
    step(scheduler)
    step(scheduler)  # 16 tokens computed: the cache is full
    with pytest.raises(RuntimeError, match="do not fit in the whole KV cache"):
        scheduler.schedule()


# ---------------------------------------------------------------- stopping


@pytest.mark.parametrize(
    ("sampling", "script", "tokens", "finish_reason", "stop_reason"),
    [
        ({}, [5, EOS, 6], [5, EOS], FinishReason.STOP, None),
        ({"stop_token_ids": [42]}, [5, 42, 6], [5, 42], FinishReason.STOP, 42),
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        ({"min_tokens": 2}, [EOS, EOS, 7, EOS], [EOS, EOS], FinishReason.STOP, None),
        ({"min_tokens": 3}, [EOS, EOS, 7, EOS], [EOS, EOS, 7, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], [EOS, EOS, EOS], FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(sampling, script, tokens, finish_reason, stop_reason):
    scheduler = create_scheduler()
    sampling = {"max_tokens": 10, **sampling}
    scheduler.add_request(create_request("r", 5, **sampling))
    finals, produced = run_to_completion(scheduler, scripted({"r": list(script)}))
    assert produced["r"] == tokens
    assert finals["r"].finish_reason == finish_reason
    assert finals["r"].stop_reason == stop_reason
    assert_all_blocks_free(scheduler)


def test_max_model_len_caps_generation():
    scheduler = create_scheduler(max_model_len=8)
    scheduler.add_request(create_request("r", 6, max_tokens=100))
    finals, produced = run_to_completion(scheduler)
    assert produced["r"] == [TOKEN, TOKEN]  # 6 + 2 = max_model_len tokens
    assert finals["r"].finish_reason == FinishReason.LENGTH


def test_prompt_of_exactly_max_model_len_finishes_even_when_chunked():
    # Its last prompt token sits at position max_model_len - 1: it must still be scheduled,
    # or the request would wait forever for a token that never comes.
    scheduler = create_scheduler(max_model_len=16, max_num_batched_tokens=6)
    scheduler.add_request(create_request("r", 16, max_tokens=100))
    finals, produced = run_to_completion(scheduler, max_steps=5)
    assert produced["r"] == [TOKEN]
    assert finals["r"].finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(scheduler)


def test_tokens_after_a_stop_are_dropped_with_their_logprobs():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("r", 4, stop_token_ids=[42]))
    out = scheduler.schedule()
    rows = LogprobsLists(
        logprob_token_ids=[[5], [42], [6]], logprobs=[[-0.1], [-0.2], [-0.3]], ranks=[1, 1, 1]
    )
    eco = scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[5, 42, 6]], logprobs={"r": rows}
        ),
    )
    (output,) = eco[0].outputs
    assert output.new_token_ids == [5, 42]
    assert output.new_logprobs.ranks == [1, 1] and output.new_logprobs.logprob_token_ids == [[5], [42]]
    assert output.stop_reason == 42
    assert_all_blocks_free(scheduler)


def test_prompt_logprobs_of_a_partial_chunk_are_emitted_without_tokens():
    scheduler = create_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(create_request("r", 6, prompt_logprobs=0))
    out = scheduler.schedule()
    rows = LogprobsLists(logprob_token_ids=[[11], [12], [13]], logprobs=[[-1.0]] * 3, ranks=[2, 1, 3])
    eco = scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[]], prompt_logprobs_dict={"r": rows}
        ),
    )
    (output,) = eco[0].outputs
    assert output.new_token_ids == [] and not output.finished
    assert output.new_prompt_logprobs.ranks == [2, 1, 3]


# ---------------------------------------------------------------- aborts and bookkeeping


def test_abort_running_and_waiting_frees_blocks_and_tells_the_workers():
    scheduler = create_scheduler(max_num_seqs=1)
    scheduler.add_request(create_request("running", 9))
    scheduler.add_request(create_request("waiting", 9))
    step(scheduler)
    assert scheduler.get_request_counts() == (1, 1)
    assert scheduler.kv_cache_manager.usage > 0

    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert scheduler.get_request_counts() == (0, 0)
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()
    assert_all_blocks_free(scheduler)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"running", "waiting"}
    assert out.total_num_scheduled_tokens == 0
    assert scheduler.schedule().finished_req_ids == set()  # handed over once
    assert not scheduler.has_requests()


def test_abort_during_a_step_drops_its_output():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("gone", 4))
    scheduler.add_request(create_request("kept", 4))
    out = scheduler.schedule()
    runner_output = model_runner_output(scheduler, out)
    scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    eco = scheduler.update_from_output(out, runner_output)
    assert [o.request_id for o in eco[0].outputs] == ["kept"]
    assert scheduler.schedule().finished_req_ids == {"gone"}


def test_outputs_go_to_their_client_and_stats_to_client_zero():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("x", 5, client_index=1))
    scheduler.add_request(create_request("y", 7, client_index=1))
    _, _, eco = step(scheduler)
    assert set(eco) == {0, 1}
    assert eco[0].outputs == []
    assert [o.request_id for o in eco[1].outputs] == ["x", "y"]
    stats = eco[0].scheduler_stats
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 0
    assert stats.step_counter == 1
    assert stats.num_scheduled_tokens == 12
    assert stats.kv_cache_usage == pytest.approx(2 / 100)  # 1 + 1 blocks of 100 usable
    assert eco[1].scheduler_stats is None

    quiet = Scheduler(
        scheduler.scheduler_config, scheduler.cache_config, scheduler.kv_cache_config, log_stats=False
    )
    quiet.add_request(create_request("z", 3))
    _, _, eco = step(quiet)
    assert eco[0].scheduler_stats is None and quiet.make_stats() is None


def test_add_request_rejects_what_could_never_run():
    scheduler = create_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(create_request("long", 9))
    scheduler.add_request(create_request("r", 8))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(create_request("r", 3))
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(
            scheduler.scheduler_config,
            CacheConfig(block_size=16),
            scheduler.kv_cache_config,
        )


def test_busy_mixed_workload_ends_with_every_block_free():
    scheduler = create_scheduler(num_blocks=7, max_num_batched_tokens=16, max_num_seqs=4)
    shared_block = [7] * BLOCK_SIZE  # e.g. a system prompt
    for i in range(8):
        prompt = shared_block + list(range(100 * i, 100 * i + 3 * i))
        scheduler.add_request(create_request(f"r{i}", prompt, max_tokens=6 + i % 3))
    finals, produced = run_to_completion(scheduler)
    assert set(finals) == {f"r{i}" for i in range(8)}
    assert all(len(produced[f"r{i}"]) == 6 + i % 3 for i in range(8))
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0  # 6 blocks for 4 running requests: some were preempted
    assert stats.prefix_cache_hits > 0
    assert_all_blocks_free(scheduler)


# Import rules (sched and kv_cache import no torch, ZMQ or HTTP): tests/e2e/test_import_rules.py.
