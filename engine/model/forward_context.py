"""What one forward pass needs that is not a tensor: the step's attention metadata and the
KV caches, for the compiled model's attention op.

Mirrors vLLM's ``vllm/forward_context.py`` (``set_forward_context`` /
``get_forward_context``). The eager model takes ``attn_metadata`` and ``kv_caches`` as
arguments of ``forward``; the compiled one cannot: ``torch.compile`` would trace the
metadata's plain ints and lists (how many decodes, each request's start) into guards and
compile a new graph for every batch. So the compiled graph takes only token tensors, and
each attention layer calls the ``glassbox::attention`` op (``engine/model/cpu/compile.py``)
with its layer index; the op reads the metadata and its cache from here (and each MoE layer's
``glassbox::moe_forward`` op its layer, ``engine/model/moe.py``). The model runner sets the
context around every compiled forward; the eager one never reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model.attention import Attention, AttentionMetadata, KVCache
    from engine.model.moe import FusedMoE


@dataclass
class ForwardContext:
    """``attn_metadata``: this step's batch; ``kv_caches``: one (K, V) pair per local layer,
    or None (the profiling run); ``layers``: the attention layers, by local layer index;
    ``moe_layers``: the MoE layers' routed experts (``FusedMoE``), by local layer index (the
    ``glassbox::moe_forward`` op reads them; empty for a dense model)."""

    attn_metadata: AttentionMetadata
    kv_caches: list[KVCache] | None
    layers: list[Attention]
    moe_layers: dict[int, FusedMoE] = field(default_factory=dict)


_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: list[KVCache] | None,
    layers: list[Attention],
    moe_layers: dict[int, FusedMoE] | None = None,
) -> Iterator[None]:
    """Make this step's metadata and caches (and the MoE layers) visible to the compiled
    graph's attention and MoE ops while the block runs."""
    global _context
    previous, _context = _context, ForwardContext(attn_metadata, kv_caches, layers, moe_layers or {})
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward running now.

    Raises:
        RuntimeError: no forward is running (the op was called outside ``set_forward_context``).
    """
    if _context is None:
        raise RuntimeError("the attention op ran outside set_forward_context (no step is running)")
    return _context
