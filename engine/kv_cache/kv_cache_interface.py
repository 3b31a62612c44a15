"""What the worker tells the engine core about its KV cache, and what it gets back.

Mirrors vLLM's ``vllm/v1/kv_cache_interface.py`` for the one case we implement: every
layer is full attention (or sliding-window attention with the same page shape), so all
layers form one KV-cache group and share one block table.

``kv_cache_spec`` is the one place a page shape is worked out from the model's numbers: the
first process uses it to check a fixed KV budget before anything is spawned, and each
worker to report its page shape (vLLM's workers read it off their attention layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from engine.config import ModelConfig


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


def kv_cache_spec(
    model_config: ModelConfig,
    *,
    block_size: int,
    tensor_parallel_size: int,
    num_layers: int,
    dtype_size: int,
    sliding_window: int | None = None,
) -> FullAttentionSpec:
    """One worker's KV page shape, from ``config.json``'s numbers.

    A block then costs ``2 * block_size * num_layers * num_kv_heads * head_dim * dtype_size``
    bytes (``bytes_per_block``), with ``num_kv_heads = num_key_value_heads //
    tensor_parallel_size``, at least 1 (with more TP ranks than KV heads each head is
    replicated, vLLM's rule).

    Args:
        model_config: gives ``num_key_value_heads`` and ``head_dim``.
        block_size: tokens per block.
        tensor_parallel_size: the TP ranks the KV heads are split over.
        num_layers: decoder layers this worker holds (its pipeline stage's).
        dtype_size: bytes per element of the cache (the model's dtype).
        sliding_window: the window every layer shares, in tokens; None for full attention.
    """
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(model_config.num_key_value_heads // tensor_parallel_size, 1),
        head_size=model_config.head_dim,
        dtype_size=dtype_size,
        num_layers=num_layers,
        sliding_window=sliding_window,
    )


class KVCacheConfig(msgspec.Struct, kw_only=True):
    """The sized KV cache: ``num_blocks`` blocks of ``spec.block_size`` tokens each.

    Block 0 is the null block (never holds data), so ``num_blocks - 1`` are usable.
    """

    num_blocks: int
    spec: FullAttentionSpec
