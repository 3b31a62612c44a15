"""Pooling requests in the scheduler: all prefill, chunked under LAST pooling, whole under MEAN/CLS,
finished by the step that brings their vector, their blocks freed at once.

Driven step by step with hand-made model-runner outputs, as ``test_scheduler.py``: the fake
runner returns a vector only for a request whose whole prompt is computed after the step
(vLLM's ``finished_mask``), None for a chunk. Pure logic, no model.
"""

from __future__ import annotations

import numpy as np

from engine.config import CacheConfig, SchedulerConfig
from engine.core.messages import EngineCoreOutput, FinishReason
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.kv_cache.kv_cache_utils import get_request_block_hasher
from engine.outputs import Float32Tensor, ModelRunnerOutput
from engine.pooling_params import PoolingParams
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler

BLOCK_SIZE = 8
NUM_BLOCKS = 41


def make_scheduler(
    budget: int, max_model_len: int = 64, chunked: bool = True, caching: bool = True
) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_size=4, num_layers=1)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len,
                        enable_chunked_prefill=chunked),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
        KVCacheConfig(num_blocks=NUM_BLOCKS, spec=spec),
    )  # fmt: skip


def pooling_request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id, prompt, None, eos_token_id=2, arrival_time=1.0,
        block_hasher=get_request_block_hasher(BLOCK_SIZE), pooling_params=PoolingParams(task="embed"),
    )  # fmt: skip


def vector_of(request: Request) -> np.ndarray:
    """The fake model's embedding of a request: its prompt's sum, and its length."""
    return np.array([sum(request.prompt_token_ids), request.num_prompt_tokens], dtype=np.float32)


def pool_step(scheduler: Scheduler) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """One step whose runner pools: a vector for each request whose prompt is complete after it."""
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    vectors = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens == request.num_prompt_tokens  # counted when scheduled
        vectors.append(Float32Tensor.from_numpy(vector_of(request)) if done else None)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids], pooler_output=vectors,
    )  # fmt: skip
    outputs = scheduler.update_from_output(so, runner_output)
    return so, {o.request_id: o for eco in outputs.values() for o in eco.outputs}


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_last_pooling_prompt_is_chunked_and_finishes_with_its_vector():
    scheduler = make_scheduler(budget=16)
    prompt = list(range(10, 50))  # 40 tokens: chunks of 16, 16, 8
    scheduler.add_request(pooling_request("a", prompt))
    chunks = []
    for _ in range(2):
        so, outputs = pool_step(scheduler)
        chunks.append(so.num_scheduled_tokens["a"])
        assert outputs == {}, "a chunk that leaves part of the prompt brings nothing to the client"
    so, outputs = pool_step(scheduler)
    chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 8]

    out = outputs["a"]
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert out.pooling_output.numpy().tolist() == [float(sum(prompt)), 40.0]
    # Finished with its vector: forgotten, its blocks free again, the workers told next step.
    assert not scheduler.has_unfinished_requests()
    assert free_blocks(scheduler) == NUM_BLOCKS - 1
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_a_pooling_prompt_may_fill_the_context():
    scheduler = make_scheduler(budget=64, max_model_len=64)
    scheduler.add_request(pooling_request("full", list(range(100, 164))))  # max_model_len tokens
    so, outputs = pool_step(scheduler)
    assert so.num_scheduled_tokens == {"full": 64}
    assert outputs["full"].finished and outputs["full"].pooling_output.shape == [2]


def test_without_chunked_prefill_each_prompt_is_scheduled_whole():
    # MEAN/CLS pooling's config: chunked prefill and prefix caching off, budget >= max_model_len.
    scheduler = make_scheduler(budget=64, chunked=False, caching=False)
    scheduler.add_request(pooling_request("a", list(range(10, 50))))  # 40 tokens
    scheduler.add_request(pooling_request("b", list(range(60, 90))))  # 30: not in the 24 left
    so, outputs = pool_step(scheduler)
    assert so.num_scheduled_tokens == {"a": 40} and set(outputs) == {"a"}
    so, outputs = pool_step(scheduler)
    assert so.num_scheduled_tokens == {"b": 30} and set(outputs) == {"b"}
    assert outputs["b"].pooling_output.numpy().tolist() == [float(sum(range(60, 90))), 30.0]


def test_last_pooling_reads_the_prefix_cache_and_still_computes_the_last_token():
    scheduler = make_scheduler(budget=64)
    prompt = list(range(10, 42))  # 32 tokens: 4 full blocks
    scheduler.add_request(pooling_request("first", prompt))
    pool_step(scheduler)
    scheduler.add_request(pooling_request("again", prompt))
    so, outputs = pool_step(scheduler)
    # A full hit would leave nothing to compute: the last block is recomputed, and its last
    # token's hidden state is the vector.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    assert so.num_scheduled_tokens == {"again": 8}
    assert outputs["again"].num_cached_tokens == 24 and outputs["again"].finished
