"""What the worker tells the engine core about its KV cache, and what it gets back.

Mirrors vLLM's ``vllm/v1/kv_cache_interface.py`` for the one case we implement: every
layer is full attention (or sliding-window attention with the same page shape), so all
layers form one KV-cache group and share one block table.
"""

from __future__ import annotations

import msgspec


class FullAttentionSpec(msgspec.Struct, kw_only=True):
    """Shape of one layer's KV cache page.

    A page holds ``block_size`` tokens of K and of V for one layer:
    ``page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_size``.
    ``num_kv_heads`` is per worker (already divided by the tensor-parallel size).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int  # bytes per element: 4 (float32), 2 (bfloat16/float16)
    num_layers: int
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers (what one block id costs)."""
        return self.page_size_bytes * self.num_layers


class KVCacheConfig(msgspec.Struct, kw_only=True):
    """The sized KV cache: ``num_blocks`` blocks of ``spec.block_size`` tokens each.

    Block 0 is the null block (never holds data), so ``num_blocks - 1`` are usable.
    """

    num_blocks: int
    spec: FullAttentionSpec
