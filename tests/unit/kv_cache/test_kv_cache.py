"""KV cache management: block hashes, the free queue, the block pool, the manager.

In the style of vLLM's ``tests/v1/core/test_prefix_caching.py`` and
``test_kv_cache_utils.py``: real objects, tiny block sizes, block ids asserted exactly so
the eviction order is visible. No torch.
"""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.kv_cache.kv_cache_manager import KVCacheManager
from engine.kv_cache.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
)
from engine.sampling_params import SamplingParams
from engine.sched.request import Request

BLOCK_SIZE = 4


def make_request(
    request_id: str, prompt: list[int], block_size: int = BLOCK_SIZE, prompt_logprobs: int | None = None
) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(block_size),
    )


def make_manager(num_blocks: int, enable_caching: bool = True, max_model_len: int = 256) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_size=4, num_layers=1)
    return KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, spec=spec),
        max_model_len=max_model_len,
        enable_caching=enable_caching,
    )


def allocate_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedule the whole prompt after its prefix hit, as the scheduler would; return its block ids."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks) is not None
    manager.record_prefix_cache_stats(request, num_hit)  # counted at admission, as the scheduler does
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)[0]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


# ---------------------------------------------------------------- hashing


def test_block_hash_is_chained_and_deterministic():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))  # no parent means NONE_HASH
    assert first == hash_block_tokens(None, [1, 2, 3, 4])  # stable across calls (not hash())
    assert len(first) == 32
    # The same tokens after a different prefix are a different block.
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("salt",)) != first


def test_request_block_hasher_hashes_only_full_blocks_and_extends_on_append():
    request = make_request("r", list(range(10)))  # 2 full blocks + 2 tokens
    assert request.block_hashes == [
        hash_block_tokens(None, [0, 1, 2, 3]),
        hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]
    request.append_output_token_ids(10)
    assert len(request.block_hashes) == 2  # 11 tokens: the third block is not full yet
    request.append_output_token_ids(11)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [8, 9, 10, 11])


# ---------------------------------------------------------------- free queue


def test_free_queue_order_and_o1_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]

    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4]
    queue.append(blocks[2])
    queue.append_n([blocks[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 3, 4]
    assert queue.num_free_blocks == 2

    with pytest.raises(ValueError):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()


# ---------------------------------------------------------------- block pool


def test_null_block_is_block_zero_and_never_counted():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0

    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(0.5)

    pool.free_blocks([pool.null_block, *blocks])  # the null block is skipped, not counted
    assert pool.null_block.ref_cnt == 0
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(num_gpu_blocks=3, enable_caching=True)  # 2 usable blocks
    request = make_request("r", [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], num_cached_blocks=0, num_full_blocks=1, block_size=BLOCK_SIZE)
    block_hash = request.block_hashes[0]
    assert pool.get_cached_block(block_hash) is block

    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.get_cached_block(block_hash) is block  # free, yet still a hit

    pool.touch([block])  # a prefix hit revives it: out of the free queue
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([block])

    reused = pool.get_new_blocks(2)  # now the pool needs it: the stale hash is evicted
    assert block in reused
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(num_gpu_blocks=3, enable_caching=True)
    request = make_request("r", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, BLOCK_SIZE)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]

    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert blocks[0].block_hash is None


# ---------------------------------------------------------------- manager


def test_prefix_hit_of_shared_prefix_reuses_blocks_and_counts_stats():
    manager = make_manager(num_blocks=11)
    a = make_request("a", list(range(10)))  # blocks [0..3], [4..7], partial [8, 9]
    a_ids = allocate_prompt(manager, a)
    assert a_ids == [1, 2, 3]

    b = make_request("b", [*range(8), 50, 51, 52, 53, 54])  # shares the first 2 blocks
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert hit_blocks.get_block_ids() == ([1, 2],)
    new_blocks = manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit_blocks)
    manager.record_prefix_cache_stats(b, num_hit)
    assert new_blocks.get_block_ids() == ([4, 5],)  # only the new ones are returned
    assert manager.get_block_ids("b") == ([1, 2, 4, 5],)
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]

    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 10 + 13, 0 + 8)
    assert manager.make_prefix_cache_stats().queries == 0  # handed over, then fresh


def test_hit_never_covers_the_last_token():
    manager = make_manager(num_blocks=11)
    a = make_request("a", list(range(8)))  # exactly 2 blocks
    allocate_prompt(manager, a)
    same = make_request("same", list(range(8)))
    _, num_hit = manager.get_computed_blocks(same)
    assert num_hit == 4  # all but the last block: its last token must be recomputed for logits
    longer = make_request("longer", list(range(9)))
    _, num_hit = manager.get_computed_blocks(longer)
    assert num_hit == 8


def test_no_hit_without_caching_or_with_prompt_logprobs():
    for manager, request in [
        (make_manager(num_blocks=11, enable_caching=False), make_request("b", list(range(10)))),
        (make_manager(num_blocks=11), make_request("b", list(range(10)), prompt_logprobs=1)),
    ]:
        allocate_prompt(manager, make_request("a", list(range(10))))
        hit_blocks, num_hit = manager.get_computed_blocks(request)
        assert num_hit == 0 and len(hit_blocks) == 0


def test_allocate_slots_grows_block_table_one_block_at_a_time():
    manager = make_manager(num_blocks=11)
    request = make_request("r", list(range(6)))
    assert manager.allocate_slots(request, 6).get_block_ids() == ([1, 2],)
    request.num_computed_tokens = 6
    request.append_output_token_ids(100)  # 7 tokens: still fits in 2 blocks
    assert manager.allocate_slots(request, 1).get_block_ids() == ([],)
    request.num_computed_tokens = 7
    request.append_output_token_ids(101)
    request.num_computed_tokens = 8
    request.append_output_token_ids(102)  # the 9th token needs a third block
    assert manager.allocate_slots(request, 1).get_block_ids() == ([3],)
    assert manager.get_block_ids("r") == ([1, 2, 3],)
    with pytest.raises(ValueError):
        manager.allocate_slots(request, 0)


def test_allocate_slots_counts_free_hit_blocks_as_used_capacity():
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    a = make_request("a", list(range(9)))
    allocate_prompt(manager, a)  # [1, 2, 3]; blocks 1 and 2 are full and cached
    manager.free(a)
    other = make_request("other", [90, 91])
    allocate_prompt(manager, other)  # takes one free block: 3 left, two of them the hits
    assert manager.block_pool.get_num_free_blocks() == 3

    b = make_request("b", [*range(8), 60, 61, 62, 63, 64])  # 13 tokens: 2 hit + 2 new blocks
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert hit_blocks.get_block_ids() == ([1, 2],)
    # 2 new blocks would fit in 3 free ones, but taking the 2 hits out of the free queue
    # uses up 2 of those 3 as well.
    assert manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit_blocks) is None
    # A refusal changes nothing.
    assert manager.block_pool.get_num_free_blocks() == 3
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert manager.get_computed_blocks(b)[1] == 8

    manager.free(other)
    hit_blocks, num_hit = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit_blocks) is not None
    assert manager.block_pool.get_num_free_blocks() == 0


def test_eviction_order_least_recently_freed_first_and_tail_blocks_first():
    manager = make_manager(num_blocks=9)  # 8 usable blocks
    a = make_request("a", list(range(12)))  # 3 full blocks
    b = make_request("b", list(range(100, 108)))  # 2 full blocks
    assert allocate_prompt(manager, a) == [1, 2, 3]
    assert allocate_prompt(manager, b) == [4, 5]
    manager.free(a)  # reversed: a's tail block is first in line
    manager.free(b)
    assert free_ids(manager) == [6, 7, 8, 3, 2, 1, 5, 4]

    # Freed blocks are still hits: a comes back and finds all 3 blocks (hit capped at 2).
    a_again = make_request("a2", list(range(12)))
    assert manager.get_computed_blocks(a_again)[1] == 8

    # A newcomer needing 5 blocks takes never-used blocks, then a's tail, then a's middle.
    c = make_request("c", list(range(200, 220)))
    assert allocate_prompt(manager, c) == [6, 7, 8, 3, 2]
    assert free_ids(manager) == [1, 5, 4]
    # a's first block survived (the most shareable one), b was freed later so it is untouched.
    assert manager.get_computed_blocks(make_request("a3", list(range(12))))[1] == 4
    assert manager.get_computed_blocks(make_request("b2", list(range(100, 109))))[1] == 8


def test_decode_blocks_are_cached_once_full():
    manager = make_manager(num_blocks=11)
    r = make_request("r", [1, 2, 3])
    manager.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    r.append_output_token_ids(4)  # the first block is now full (tokens 1..4)
    manager.allocate_slots(r, 1)
    r.num_computed_tokens = 4
    manager.free(r)
    twin = make_request("twin", [1, 2, 3, 4, 5])
    assert manager.get_computed_blocks(twin)[1] == 4


def test_free_returns_every_block_and_usage_drops_to_zero():
    manager = make_manager(num_blocks=11)
    requests = [make_request(f"r{i}", list(range(i, i + 7))) for i in range(4)]
    for request in requests:
        allocate_prompt(manager, request)
    assert manager.usage == pytest.approx(8 / 10)
    for request in requests:
        manager.free(request)
    manager.free(requests[0])  # freeing twice is a no-op
    assert manager.block_pool.get_num_free_blocks() == 10
    assert manager.usage == 0.0
    assert manager.reset_prefix_cache() is True
    assert manager.make_prefix_cache_stats().reset is True


def test_the_count_of_free_cached_blocks_is_what_the_free_queue_holds():
    # engine-top's "cached" blocks (kv.blocks_cached): free blocks that still carry a hash,
    # counted as blocks move, never by walking the queue; checked against a walk after every
    # admission and free of a workload with shared prefixes, hits on free blocks and evictions.
    import random

    rng = random.Random(7)
    manager = make_manager(num_blocks=12)
    pool = manager.block_pool
    live: list[Request] = []
    for i in range(300):
        if live and (rng.random() < 0.5 or pool.get_num_free_blocks() < 4):
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
            request = make_request(
                f"r{i}", prefix + [100 + rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            )
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks) is not None:
                live.append(request)
        walked = sum(1 for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None)
        assert pool.num_free_cached_blocks == walked, i
    for request in live:
        manager.free(request)
    assert manager.reset_prefix_cache() and pool.num_free_cached_blocks == 0
