"""Paged attention in plain torch, the metadata that describes one step's batch, and the
attention-backend interface.

Mirrors vLLM's ``vllm/attention/layer.py`` (``Attention``), the metadata its backends build
(``vllm/v1/attention/backends/``; ``CommonAttentionMetadata``) and its backend interface
(``vllm/attention/backends/abstract.py``: ``AttentionBackend``, ``AttentionImpl``). A backend
is chosen by name, ``--attention-backend`` (vLLM: ``VLLM_ATTENTION_BACKEND``), through
``engine/model/attention_selector.py``. This file holds the reference, ``TORCH_SDPA``: torch
gathers the pages a request owns into a dense tensor (``index_select``) and calls
``scaled_dot_product_attention`` (SDPA). Every step is an ordinary tensor operation a reader
can print. The faster backends, ``PAGED_INDUCTOR`` and ``CPU_PAGED_CPP`` (the default on a
CPU where its C++ kernel builds), live in ``engine/model/cpu/attention_backends.py``: they
subclass ``AttentionImpl`` and replace only how decodes read the cache (in place, page by
page); cache writes and prefill chunks are this file's in all three.

The KV cache of one layer is two tensors, K and V, each
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token ``p`` of a request lives in
slot ``block_table[p // block_size] * block_size + p % block_size``; the model runner
computes these slots (``slot_mapping``) and new K/V are written through them before
attention reads the cache.

One step mixes two kinds of request, and the runner orders the batch so that all
*decodes* (one query token) come first, then the *prefill chunks*:

- decodes are batched: ``TORCH_SDPA`` gathers their pages into one padded
  ``(num_decodes, max_len, kv_heads, head_dim)`` tensor and a length mask hides the
  padding (the other backends read the pages in place instead).
- each prefill chunk runs on its own, attending to its cached prefix plus itself. Its
  causal mask is aligned *bottom-right*: query ``t`` of a chunk that follows ``c`` cached
  tokens sits at position ``c + t`` and sees keys ``0..c + t``. SDPA's ``is_causal`` aligns
  the mask top-left, which is only right when ``c == 0``. A long prefill is never padded
  together with decodes into one dense tensor, which would waste
  ``num_decodes × prefill_len²`` work.

In the eager model there is no hidden global "forward context" (vLLM's
``set_forward_context``): the ``AttentionMetadata`` is an argument of every forward, and this
file imports no forward context. Under ``torch.compile`` (``engine/model/cpu/compile.py``,
the default unless ``--enforce-eager``) each layer's attention is one opaque op of the graph,
``glassbox::attention``, defined there: it runs ``Attention.forward`` eagerly, with the step's
metadata and this layer's cache taken from the forward context
(``engine/model/forward_context.py``), so the graph never reads the metadata's plain ints and
one graph serves every batch.

Left out: hand-written GPU kernels, cascade attention, cross-attention, encoder-only attention,
attention sinks, ALiBi, logits soft-capping, FP8 KV caches, a backend's own metadata class and
builder (one ``AttentionMetadata`` serves all three).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V: (num_blocks, block_size, num_kv_heads, head_dim)


@dataclass
class AttentionMetadata:
    """One step's batch, as attention needs it. Built by the model runner.

    Requests ``[0, num_decodes)`` have exactly one query token (decodes); requests
    ``[num_decodes, num_reqs)`` are prefill chunks. Tokens are laid out request by request,
    in the same order.

    Device tensors:
        slot_mapping: ``(num_tokens,)`` int64, the cache slot each new token's K/V goes to.
        query_start_loc: ``(num_reqs + 1,)`` int32, where each request's tokens start.
        seq_lens: ``(num_reqs,)`` int32, tokens in the cache after this step.
        block_table: ``(num_reqs, max_num_blocks)`` int32, each request's block ids
            (unused entries are 0, the null block).

        decode_slots: ``(num_decodes, max_decode_seq_len)`` int64, the flat cache slot of
            each key of each decode (positions past a decode's length hold whatever its block
            table row holds there and are masked by ``seq_lens``); built for
            ``PAGED_INDUCTOR`` only, None otherwise and when the step has no decode.

    Host copies (plain ints, so the prefill loop never waits on the device):
        query_start_loc_cpu, seq_lens_cpu, num_computed_tokens_cpu (tokens already in the
        cache before this step: the context a chunk follows), max_decode_seq_len.

    ``is_profile``: no KV cache exists yet (the memory-profiling run); every request is a
    prefill from position 0 and attends causally to itself only.
    """

    num_reqs: int
    num_decodes: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_computed_tokens_cpu: list[int]
    max_decode_seq_len: int
    block_size: int
    is_profile: bool = False
    decode_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @classmethod
    def for_profile(cls, seq_lens: list[int], device: torch.device) -> AttentionMetadata:
        """Metadata for a run with no KV cache: each of ``seq_lens`` is a fresh prefill."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return cls(
            num_reqs=len(seq_lens),
            num_decodes=0,
            slot_mapping=empty.long(),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=empty.view(len(seq_lens), 0) if seq_lens else empty.view(0, 0),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
            num_computed_tokens_cpu=[0] * len(seq_lens),
            max_decode_seq_len=0,
            block_size=1,
            is_profile=True,
        )


class AttentionImpl:
    """How a layer attends: the reference, ``TORCH_SDPA`` (vLLM: ``AttentionImpl``; its CPU
    ``TorchSDPABackendImpl``). Writes the step's K/V into the cache, then attends for the
    decodes (``forward_decode``: gather + SDPA) and for each prefill chunk. A faster backend's
    impl subclasses this one and replaces ``forward_decode``.

    Args:
        num_heads, head_dim, num_kv_heads, scale, sliding_window: as ``Attention``'s.
    """

    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, sliding_window: int | None
    ) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the step's K/V into the cache (unless profiling), then attend for every decode
        and every prefill chunk; returns ``(num_tokens, num_heads, head_dim)``."""
        if kv_cache is not None and not meta.is_profile:
            k_cache, v_cache = kv_cache
            flat = (-1, self.num_kv_heads, self.head_dim)
            k_cache.view(flat).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(flat).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
        nd = meta.num_decodes
        if nd > 0:
            assert kv_cache is not None, "decodes need a KV cache"
            out[:nd] = self.forward_decode(q[:nd], kv_cache, meta)
        for i in range(nd, meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            out[start:end] = self._prefill(i, q[start:end], k[start:end], v[start:end], kv_cache, meta)
        return out

    def forward_decode(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """All one-token queries at once: ``q`` (num_decodes, num_heads, head_dim) → same shape."""
        nd, bs = q.shape[0], meta.block_size
        num_blocks = -(-meta.max_decode_seq_len // bs)
        # (num_decodes * num_blocks,) int64: index_select is several times faster than
        # indexing with the 2-D int32 table (measured: 1.7 ms against 9 ms per layer).
        blocks = meta.block_table[:nd, :num_blocks].reshape(-1).long()
        max_len = num_blocks * bs
        # (num_decodes * num_blocks, block_size, kv_heads, head_dim) -> (num_decodes, kv_heads, max_len, head_dim)
        shape = (nd, max_len, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0].index_select(0, blocks).view(shape).transpose(1, 2)
        values = kv_cache[1].index_select(0, blocks).view(shape).transpose(1, 2)
        key_pos = torch.arange(max_len, device=q.device)[None, :]  # (1, max_len)
        seq_lens = meta.seq_lens[:nd, None]  # (num_decodes, 1)
        mask = key_pos < seq_lens  # (num_decodes, max_len): hides each row's padding
        if self.sliding_window is not None:
            # The query sits at position seq_len - 1 and sees keys > seq_len - 1 - window.
            mask &= key_pos >= seq_lens - self.sliding_window
        o = F.scaled_dot_product_attention(  # one query each: bfloat16 is fast enough here
            q[:, :, None, :],  # (num_decodes, num_heads, 1, head_dim)
            keys,
            values,
            attn_mask=mask[:, None, None, :],  # (num_decodes, 1, 1, max_len)
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (num_decodes, num_heads, 1, head_dim)
        return o[:, :, 0, :]

    def _prefill(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One chunk of request ``i``: ``q`` (n, num_heads, head_dim) → (n, num_heads, head_dim)."""
        n = q.shape[0]
        context = meta.num_computed_tokens_cpu[i]  # cached tokens before this chunk
        seq_len = context + n
        window = self.sliding_window
        if context == 0:
            # Nothing cached before the chunk: its own K/V are all it can see.
            key_start, keys, values = 0, k, v  # (n, kv_heads, head_dim)
        else:
            assert kv_cache is not None, "a chunk after cached tokens needs the KV cache"
            # The first query (position `context`) sees nothing before context + 1 - window.
            key_start = max(0, context + 1 - window) if window is not None else 0
            keys, values = self._gather(i, key_start, seq_len, kv_cache, meta)  # (S, kv_heads, head_dim)

        mask = None
        if context > 0 or (window is not None and n > window):
            q_pos = torch.arange(context, seq_len, device=q.device)[:, None]  # (n, 1)
            k_pos = torch.arange(key_start, seq_len, device=q.device)[None, :]  # (1, S)
            mask = k_pos <= q_pos  # bottom-right causal: (n, S)
            if window is not None:
                mask &= k_pos > q_pos - window
        o = _sdpa(
            q.transpose(0, 1)[None],  # (1, num_heads, n, head_dim)
            keys.transpose(0, 1)[None],  # (1, kv_heads, S, head_dim)
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,  # top-left alignment is right only when context == 0
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (1, num_heads, n, head_dim)
        return o[0].transpose(0, 1)

    def _gather(
        self, i: int, key_start: int, seq_len: int, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of request ``i`` at positions ``[key_start, seq_len)``, each (S, kv_heads, head_dim)."""
        bs = meta.block_size
        first_block, end_block = key_start // bs, -(-seq_len // bs)
        blocks = meta.block_table[i, first_block:end_block].long()  # (num_blocks,)
        lo, hi = key_start - first_block * bs, seq_len - first_block * bs
        flat = (-1, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0].index_select(0, blocks).view(flat)[lo:hi]
        return keys, kv_cache[1].index_select(0, blocks).view(flat)[lo:hi]


class AttentionBackend:
    """One way to run attention, known by its name (vLLM: ``AttentionBackend``).

    ``get_name()`` is the ``--attention-backend`` value; ``get_impl_cls()`` the class each
    layer builds (``AttentionImpl`` or a subclass); ``prepare(device)`` does the one-time work
    before warm-up (build a kernel, compile one) and raises where the backend cannot run on
    ``device`` (deviation: vLLM's kernels are built with the wheel, so it has no such step).
    """

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def prepare(cls, device: torch.device | str | None) -> None:
        """Nothing to prepare."""


class TorchSDPABackend(AttentionBackend):
    """The reference: gather + SDPA for decodes and prefill chunks (vLLM: ``TorchSDPABackend``)."""

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return AttentionImpl


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache, with grouped-query heads.

    Args:
        num_heads: query heads on this rank.
        head_dim: size of each head.
        num_kv_heads: key/value heads on this rank (divides ``num_heads``).
        scale: multiplier of ``q·k`` (``head_dim ** -0.5`` for Llama).
        sliding_window: when set, a query at position ``p`` sees only keys at positions
            ``> p - sliding_window`` (Mistral; Qwen2 layers with ``use_sliding_window``).
        layer_index: this layer's index among this pipeline stage's layers.

    ``backend`` (an ``AttentionBackend`` class) is ``TorchSDPABackend`` until the model runner
    chooses one after loading (``set_backend``, through ``attention_selector``); ``impl`` is
    the backend's ``AttentionImpl`` for this layer.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index  # among this pipeline stage's layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.set_backend(TorchSDPABackend)

    def set_backend(self, backend: type[AttentionBackend]) -> None:
        """Attend with ``backend`` from now on (its ``prepare`` already done)."""
        self.backend = backend
        self.impl = backend.get_impl_cls()(
            self.num_heads, self.head_dim, self.num_kv_heads, self.scale, self.sliding_window
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend; returns ``(num_tokens, num_heads * head_dim)``.

        ``q`` is ``(num_tokens, num_heads, head_dim)``; ``k`` and ``v`` are
        ``(num_tokens, num_kv_heads, head_dim)``. Writes ``k``/``v`` into ``kv_cache``
        at ``slot_mapping`` first (unless profiling).

        Under ``torch.compile`` the layer is one opaque op, ``glassbox::attention``
        (``engine/model/cpu/compile.py``, which registers it), that runs this same method
        eagerly with the step's metadata and this layer's cache from the forward context.
        """
        if torch.compiler.is_compiling():
            return torch.ops.glassbox.attention(q, k, v, self.layer_index)
        out = self.impl.forward(q, k, v, kv_cache, attn_metadata)  # (num_tokens, num_heads, head_dim)
        return out.view(out.shape[0], self.num_heads * self.head_dim)


# Whether a CPU computes bfloat16/float16 prefill attention in float32. Which is faster depends
# on the CPU (torch's CPU flash kernel ran 2.3x slower in bfloat16 on an Intel Xeon without
# AMX, 3x faster on an AMD Zen 4): the CPU room measures it at load and sets this
# (engine/model/cpu/prefill_attention.py); True until then.
sdpa_upcast_on_cpu = True


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA; on a CPU, a bfloat16/float16 attention in float32 where ``sdpa_upcast_on_cpu``."""
    if sdpa_upcast_on_cpu and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
