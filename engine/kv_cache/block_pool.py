"""The pool of KV-cache blocks: who holds which block, and which hashes are cached.

The idea: every block is either *in use* (``ref_cnt`` > 0, held by one or more running
requests) or *free* (in the free queue). A free block may still carry the hash of the
tokens it holds — it stays a prefix-cache hit until the pool needs it for someone else,
and only then is its hash evicted. So "free" and "cached" are not opposites: eviction is
lazy, least recently freed first.

Mirrors vLLM's ``vllm/v1/core/block_pool.py`` (``BlockPool``). Left out: KV-cache groups
(one group, so a hash maps straight to blocks), KV events, metrics on eviction.

Pure Python: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.kv_cache.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from engine.sched.request import Request

logger = logging.getLogger(__name__)


class BlockPool:
    """All ``num_gpu_blocks`` blocks, the free queue, and the hash → block map.

    Block 0 is the null block: taken out of the free queue at start, never ref-counted,
    never freed, never handed to a request. So ``num_gpu_blocks - 1`` blocks are usable.

    Args:
        num_gpu_blocks: blocks in the KV cache, null block included (at least 1).
        enable_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        assert num_gpu_blocks >= 1, "the pool needs at least the null block"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One hash can name several blocks: two requests may compute the same prefix before
        # either is cached (e.g. one asked for prompt logprobs and skipped the lookup).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Free blocks that still carry a hash: prefix-cache hits no request holds, the first
        # to be evicted when a request needs a fresh block (engine-top's "cached" blocks).
        # Not in vLLM; kept as blocks move, so the telemetry thread reads it without walking
        # the free queue.
        self.num_free_cached_blocks = 0

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding the tokens named by ``block_hash``, or None on a miss."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Give the request's newly full blocks their hashes and make them findable.

        ``blocks[:num_cached_blocks]`` are already cached; ``blocks[num_cached_blocks:
        num_full_blocks]`` just became full and take their hashes from
        ``request.block_hashes`` (computed by the request's block hasher with the same
        ``block_size``). The caller (``KVCacheManager.cache_blocks``) only asks for blocks
        that have hashes, and only when there is at least one new full block.
        """
        new_full = slice(num_cached_blocks, num_full_blocks)
        for block, block_hash in zip(blocks[new_full], request.block_hashes[new_full], strict=True):
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, with ref_cnt 1.

        A taken block that still carried a hash is evicted from the prefix cache first.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)  # raises before taking any
        for block in blocks:
            if block.block_hash is not None:
                self.num_free_cached_blocks -= 1
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, f"{block} was in the free queue while in use"
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop a reused block's stale hash: its slots are about to be overwritten."""
        block_hash = block.block_hash
        if block_hash is None:
            return
        # A block with a hash is always in the map under it (both are set together).
        same_hash = self.cached_block_hash_to_block[block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit sitting in the free queue leaves it."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_free_cached_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those no one holds go to the free-queue tail.

        ``ordered_blocks`` is in eviction order (first = evicted first). Freed blocks keep
        their hashes, so they remain prefix-cache hits until reused.
        """
        now_free = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"{block} freed more times than it was taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                now_free.append(block)
                if block.block_hash is not None:
                    self.num_free_cached_blocks += 1
        self.free_block_queue.append_n(now_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block.

        Returns:
            True on success; False (and a warning) while blocks are still in use.
        """
        num_used = self.num_gpu_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            logger.warning("Cannot reset the prefix cache: %d blocks are still in use", num_used)
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        self.num_free_cached_blocks = 0
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not); the null block is never counted."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, 0.0 … 1.0."""
        num_usable = self.num_gpu_blocks - 1
        if num_usable == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / num_usable
