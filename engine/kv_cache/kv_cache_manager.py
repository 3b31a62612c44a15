"""The scheduler's interface to the KV cache: find prefix hits, reserve slots, free.

The idea: the scheduler never sees block ids being chosen. Before a request computes
``n`` more tokens, it asks ``allocate_slots`` for room; the manager tops the request's
block table up to ``cdiv(num_computed + n, block_size)`` blocks, or answers None when the
pool is too full — that None is what makes the scheduler preempt. A new request first asks
``get_computed_blocks`` for the longest run of its full blocks already in the cache, and
starts computing after them.

Mirrors vLLM's ``vllm/v1/core/kv_cache_manager.py`` plus the parts of
``single_type_kv_cache_manager.py`` (``FullAttentionManager``) and
``kv_cache_coordinator.py`` that one full-attention group needs. Left out: several KV-cache
groups and their coordinators, sliding-window block skipping (every layer is counted as
full attention), EAGLE lookahead slots, KV events, ``get_num_common_prefix_blocks``
(cascade attention), KV connectors.

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.kv_cache_utils import KVCacheBlock, PrefixCacheStats

if TYPE_CHECKING:
    from engine.kv_cache.kv_cache_interface import KVCacheConfig
    from engine.sched.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler, one list per KV-cache group (we have one group).

    vLLM wraps them so the scheduler never touches ``KVCacheBlock`` objects directly.
    """

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, e.g. ``([3, 7, 8],)``."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks)))

    def __len__(self) -> int:
        return len(self.blocks[0])

    @classmethod
    def new_empty(cls) -> KVCacheBlocks:
        return cls(([],))


class KVCacheManager:
    """Block tables of the running requests, over one ``BlockPool``.

    Args:
        kv_cache_config: ``num_blocks`` (null block included) and the page spec, whose
            ``block_size`` is tokens per block.
        max_model_len: no request ever needs slots past this many tokens.
        enable_caching: prefix caching on or off.
        log_stats: collect ``PrefixCacheStats``.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
    ) -> None:
        self.block_size = kv_cache_config.spec.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        # request id → its block table, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id → how many of its leading blocks are already hashed into the cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0.0 … 1.0."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Hand over the prefix-cache stats gathered since the last call (None without stats)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of the request's leading full blocks already in the cache.

        The hit never covers the whole request: at most ``num_tokens - 1`` tokens, because
        the last token must be computed to get logits to sample from (or, pooling, the
        last hidden state). A request that asks for prompt logprobs gets no hit (those need
        every prompt position computed: ``Request.skip_reading_prefix_cache``).

        A lookup only: it counts nothing in the prefix-cache stats (the scheduler calls
        ``record_prefix_cache_stats`` once the request is admitted).

        Returns:
            (the hit blocks, the number of hit tokens — a multiple of ``block_size``).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return KVCacheBlocks.new_empty(), 0

        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        # The hashes are chained, so the first miss ends the hit: a later block cannot
        # match without every block before it matching too.
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)

        return KVCacheBlocks((hit_blocks,)), len(hit_blocks) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admitted request's lookup: ``request.num_tokens`` queries, ``num_hits`` hits.

        The scheduler calls it once a waiting request got its slots, not in
        ``get_computed_blocks``: a request that does not fit is looked up again next step,
        and counting each attempt would count its tokens again (vLLM records at admission
        too, so that unscheduled lookups are not counted). A request that skipped the
        lookup (caching off, prompt logprobs) is not counted.
        """
        if self.prefix_cache_stats is None:
            return
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted=request.num_preemptions > 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step (> 0).
            num_new_computed_tokens: prefix-cache hit, in tokens (new requests only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.

        Returns:
            The newly allocated blocks (not the hit blocks; maybe none), or None when the
            pool cannot supply them — then nothing was changed.

        Raises:
            ValueError: ``num_new_tokens`` is 0.
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        hit_blocks = new_computed_blocks.blocks[0] if new_computed_blocks is not None else []
        req_blocks = self.req_to_blocks.get(request.request_id, [])

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_needing_slots = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        num_blocks_to_allocate = max(
            0, cdiv(num_tokens_needing_slots, self.block_size) - len(req_blocks) - len(hit_blocks)
        )
        # A hit block nobody holds sits in the free queue: taking it uses up free capacity
        # just as a fresh block does.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_blocks_to_allocate + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        # A new request's block table starts with its hit blocks, which are cached already.
        self.num_cached_block.setdefault(request.request_id, len(hit_blocks))
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        self.req_to_blocks.setdefault(request.request_id, []).extend(hit_blocks + new_blocks)

        if self.enable_caching:
            # Only tokens that really exist get cached (never slots reserved past them).
            self.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return KVCacheBlocks((new_blocks,))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash into the cache every block of ``request`` full within its first ``num_tokens``.

        A request built without a block hasher has no hashes, so it caches nothing.
        """
        num_full_blocks = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            self.block_size,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (a no-op if it holds none).

        Freed in reverse: the request's tail blocks reach the free queue first, so they are
        evicted before its head blocks, which other requests are likelier to share.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's whole block table."""
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group, e.g. ``([3, 7],)``."""
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False while any request still holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True
