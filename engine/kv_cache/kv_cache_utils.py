"""The pieces of the paged KV cache: blocks, the free-block queue, and prefix hashes.

The idea: the KV cache is cut into fixed-size blocks of ``block_size`` token slots. A
request holds a list of blocks (its block table). A *full* block of a request is named by
a chained hash — the hash of its tokens and of the previous block's hash — so two requests
that share a prompt prefix name the same blocks and can share them (prefix caching). A
freed block keeps its hash: it is still a cache hit until the pool hands it out again.

Mirrors vLLM's ``vllm/v1/core/kv_cache_utils.py``. Left out: hash-function choice
(always SHA-256 over msgpack), KV-cache groups (we have one: every layer is full
attention), multimodal / LoRA / cache-salt extra keys, KV events, block-count sizing (the
worker does that). Deliberate deviation: ``NONE_HASH`` is a fixed constant, not 32 random
bytes, so block hashes are the same in every run (easier to read in traces and tests).

Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

import msgspec

if TYPE_CHECKING:
    from engine.sched.request import Request

# A block's prefix hash: 32 bytes of SHA-256. It names the block's tokens *and* every token
# before them, because each hash includes its parent's.
BlockHash = NewType("BlockHash", bytes)

# The parent of a request's first block.
NONE_HASH = BlockHash(hashlib.sha256(b"glassbox: no parent block").digest())


def hash_block_tokens(
    parent_hash: BlockHash | None,
    block_token_ids: Iterable[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block, chained to the block before it.

    Args:
        parent_hash: the previous block's hash; None for a request's first block.
        block_token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the KV values (vLLM: LoRA id, multimodal
            hashes, cache salt); None here.

    Returns:
        SHA-256 of the msgpack encoding of ``(parent, tokens, extra_keys)`` — stable
        across processes and runs, unlike Python's ``hash()``.
    """
    if parent_hash is None:
        parent_hash = NONE_HASH
    payload = msgspec.msgpack.encode((parent_hash, tuple(block_token_ids), extra_keys))
    return BlockHash(hashlib.sha256(payload).digest())


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Return the function a ``Request`` calls to hash its newly completed blocks.

    The returned function hashes only the request's *full* blocks that are not in
    ``request.block_hashes`` yet, chaining from ``request.block_hashes[-1]``. ``Request``
    calls it when it is built (the prompt's full blocks) and after each appended output
    token (a decode that fills a block). A partly filled last block has no hash.
    """

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size  # first token not yet hashed
        parent = request.block_hashes[-1] if request.block_hashes else None
        token_ids = request.all_token_ids
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(token_ids):
            parent = hash_block_tokens(parent, token_ids[start : start + block_size])
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher


class KVCacheBlock:
    """One block of KV-cache slots: its id, who uses it, and its prefix hash.

    - ``block_id``: 0 … num_blocks−1; the index into the worker's KV tensors.
    - ``ref_cnt``: how many running requests hold this block. At 0 the block sits in the
      free queue (and may still carry a hash, i.e. be a prefix-cache hit).
    - ``block_hash``: set once the block is full and cached; cleared when it is evicted.
    - ``prev_free_block`` / ``next_free_block``: links of ``FreeKVCacheBlockQueue``.
    - ``is_null``: block 0, a placeholder that never holds data.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        # A block is hashed once, when it becomes full; re-hashing would orphan the old
        # entry in the pool's hash map.
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (the block is evicted from the prefix cache)."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Not the links: printing them would walk the whole free list.
        hash_hex = self._block_hash.hex()[:8] if self._block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeKVCacheBlockQueue:
    """The free blocks, in eviction order: the head is handed out (and evicted) first.

    A hand-made doubly linked list through the blocks' own ``prev_free_block`` /
    ``next_free_block`` fields, between two sentinel blocks (id −1). Unlike a deque, it
    removes a block from the middle in O(1) — needed when a prefix-cache hit revives a
    free block — and allocates nothing.

    Order: at start, by block id. Freed blocks go to the tail, so the least recently freed
    block is evicted first; callers free a request's blocks in reverse so that its tail
    blocks (the least shareable) are evicted before its head blocks.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        chain = [self.fake_head, *blocks, self.fake_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first free block. Raises ValueError when none is free."""
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` free blocks. Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue (O(1))."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, f"{block} is not in the free queue"
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it will be evicted last."""
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail, keeping their order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to evict) first. For tests and debugging."""
        blocks = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of the requests admitted since the last time the stats were taken.

    ``queries`` and ``hits`` are in tokens: a request of 100 tokens whose first 64 are
    cached adds 100 queries and 64 hits. A lookup counts once, when its request is
    admitted (``KVCacheManager.record_prefix_cache_stats``): a waiting request that finds
    no free blocks and is looked up again next step is not counted twice. A request that
    was preempted and is admitted again counts in the ``preempted_*`` fields instead: its
    hit is its own recomputed prefix, not a shared one. ``reset`` is True when the cache
    was cleared. vLLM: ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
