"""Paged attention in plain torch, and the metadata that describes one step's batch.

Mirrors vLLM's ``vllm/attention/layer.py`` (``Attention``) and the metadata its backends
build (``vllm/v1/attention/backends/``; ``CommonAttentionMetadata``). Three backends, chosen
by ``--attention-backend`` (vLLM: ``VLLM_ATTENTION_BACKEND``):

- ``TORCH_SDPA``, the reference: torch gathers the pages a request owns into a dense
  tensor (``index_select``) and calls ``scaled_dot_product_attention`` (SDPA). Every step
  is an ordinary tensor operation a reader can print.
- ``PAGED_INDUCTOR``: decodes read K/V *in place*. ``paged_decode_attention`` is written
  as plain torch ops over ``cache[slots]``; compiled by Inductor, the indexing is fused
  into the dot products and the weighted sum, so no dense copy of the K/V is ever made and
  a bfloat16 cache is never cast as a whole (each element is widened in a register).
  Prefill chunks attend as in ``TORCH_SDPA`` (they are compute-bound; the gather is a
  small part of them).
- ``CPU_PAGED_CPP`` (CPU only; the default on a CPU where the kernel builds, chosen by
  the model runner): decodes go to a hand-written C++ kernel
  (``engine/model/csrc/paged_attention_cpu.cpp``, built with g++ at start-up and called
  through ctypes; ``engine/model/paged_attention_cpu.py``) that walks each request's block
  table and reads K/V rows in place, one OpenMP task per request (all its KV heads, page by
  page) when there are two or more per thread, else per (request, KV head); all query heads
  of a KV head together — vLLM's CPU ``paged_attention_v1``. Prefill chunks as in
  ``TORCH_SDPA``.

The KV cache of one layer is two tensors, K and V, each
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token ``p`` of a request lives in
slot ``block_table[p // block_size] * block_size + p % block_size``; the model runner
computes these slots (``slot_mapping``) and new K/V are written through them before
attention reads the cache.

One step mixes two kinds of request, and the runner orders the batch so that all
*decodes* (one query token) come first, then the *prefill chunks*:

- decodes are batched: ``TORCH_SDPA`` gathers their pages into one padded
  ``(num_decodes, max_len, kv_heads, head_dim)`` tensor and a length mask hides the
  padding; ``PAGED_INDUCTOR`` reads ``decode_slots`` (each decode's cache slots, padded
  to the longest) straight from the cache with the same length mask; ``CPU_PAGED_CPP``
  follows ``block_table`` and ``seq_lens`` in C++.
- each prefill chunk runs on its own, attending to its cached prefix plus itself. Its
  causal mask is aligned *bottom-right*: query ``t`` of a chunk that follows ``c`` cached
  tokens sits at position ``c + t`` and sees keys ``0..c + t``. SDPA's ``is_causal`` aligns
  the mask top-left, which is only right when ``c == 0``. A long prefill is never padded
  together with decodes into one dense tensor, which would waste
  ``num_decodes × prefill_len²`` work.

In the eager model there is no hidden global "forward context" (vLLM's
``set_forward_context``): the ``AttentionMetadata`` is an argument of every forward.

Under ``torch.compile`` (``engine/model/compile.py``, the default unless
``--enforce-eager``), each layer's attention is one opaque op of the graph,
``glassbox::attention``: it runs ``Attention.forward`` eagerly, with the step's metadata and
this layer's cache taken from the forward context (``engine/model/forward_context.py``), so
the graph never reads the metadata's plain ints and one graph serves every batch. The
decode kernel of ``PAGED_INDUCTOR`` is compiled on its own (``set_attention_backend``).

Left out: hand-written GPU kernels, cascade attention, cross-attention, encoder-only attention,
attention sinks, ALiBi, logits soft-capping, FP8 KV caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ATTENTION_BACKENDS
from engine.model.op_threads import op_threads
from engine.model.paged_attention_cpu import load_kernel, paged_decode_attention_cpu

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


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache, with grouped-query heads.

    Args:
        num_heads: query heads on this rank.
        head_dim: size of each head.
        num_kv_heads: key/value heads on this rank (divides ``num_heads``).
        scale: multiplier of ``q·k`` (``head_dim ** -0.5`` for Llama).
        sliding_window: when set, a query at position ``p`` sees only keys at positions
            ``> p - sliding_window`` (Mistral; Qwen2 layers with ``use_sliding_window``).
        backend: ``"TORCH_SDPA"``, ``"PAGED_INDUCTOR"`` or ``"CPU_PAGED_CPP"`` (see the module
            docstring); the model runner sets it on every layer after loading
            (``set_attention_backend``).
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
        self.backend = "TORCH_SDPA"
        self.decode_kernel = None  # the compiled paged_decode_attention (PAGED_INDUCTOR)

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

        Under ``torch.compile`` the layer is one opaque op, ``glassbox::attention``, which
        runs this same method eagerly with the step's metadata and this layer's cache from
        the forward context (``engine/model/forward_context.py``).
        """
        if torch.compiler.is_compiling():
            return torch.ops.glassbox.attention(q, k, v, self.layer_index)
        meta = attn_metadata
        paged = self.backend == "PAGED_INDUCTOR" and meta.decode_slots is not None
        # Eager part: the cache write, the prefill chunks (and, for TORCH_SDPA, the decodes).
        out = self._write_and_prefill(q, k, v, kv_cache, meta, decodes=not paged)
        if paged:
            # (num_decodes, num_heads, head_dim), read in place from the pages
            decoded = self.decode_kernel(
                q[: meta.decode_slots.shape[0]],
                kv_cache[0],
                kv_cache[1],
                meta.decode_slots,
                meta.seq_lens[: meta.decode_slots.shape[0]],
                self.scale,
                self.sliding_window,
            )
            out = torch.cat([decoded, out[decoded.shape[0] :]])
        return out.view(out.shape[0], self.num_heads * self.head_dim)

    def _write_and_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        meta: AttentionMetadata,
        decodes: bool,
    ) -> torch.Tensor:
        """Write the step's K/V into the cache, then attend for every prefill chunk (and
        every decode when ``decodes``); returns ``(num_tokens, num_heads, head_dim)`` with
        the decode rows left unset otherwise."""
        if kv_cache is not None and not meta.is_profile:
            k_cache, v_cache = kv_cache
            flat = (-1, self.num_kv_heads, self.head_dim)
            k_cache.view(flat).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(flat).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
        nd = meta.num_decodes
        if nd > 0 and decodes:
            assert kv_cache is not None, "decodes need a KV cache"
            if self.backend == "CPU_PAGED_CPP":
                # The C++ kernel reads each decode's pages in place through its block table.
                out[:nd] = paged_decode_attention_cpu(
                    q[:nd], kv_cache[0], kv_cache[1], meta.block_table[:nd], meta.seq_lens[:nd],
                    self.scale, self.sliding_window,
                )  # fmt: skip
            else:
                out[:nd] = self._decode(q[:nd], kv_cache, meta)
        for i in range(nd, meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            out[start:end] = self._prefill(i, q[start:end], k[start:end], v[start:end], kv_cache, meta)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
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


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per request, attending to keys read in place from the paged cache.

    Args:
        q: ``(num_decodes, num_heads, head_dim)``.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        slots: ``(num_decodes, L)`` int64, the flat cache slot of each key position
            (``L`` = the longest decode's length; shorter rows are padded with any slot).
        seq_lens: ``(num_decodes,)``, the real length of each row; keys at positions
            ``>= seq_len`` (and, with ``sliding_window``, ``< seq_len - window``) are masked.
        scale: multiplier of ``q·k``.

    Returns ``(num_decodes, num_heads, head_dim)`` in ``q``'s dtype. Scores, softmax and the
    weighted sum are float32. In eager mode ``cache[slots]`` would be a dense copy; compiled
    by Inductor (``_paged_decode``) it becomes a load inside the reduction loops: this is
    what "paged attention" means — vLLM's ``paged_attention_v1`` kernels do the same in C++.
    """
    nd, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads  # query heads per KV head (grouped-query attention)
    keys = k_cache.view(-1, kv_heads, head_dim)[slots]  # (nd, L, kv_heads, head_dim), fused when compiled
    queries = q.view(nd, 1, kv_heads, group, head_dim)
    scores = (keys.unsqueeze(3).float() * queries.float()).sum(-1) * scale  # (nd, L, kv_heads, group)
    key_pos = torch.arange(slots.shape[1], device=q.device)[None, :]  # (1, L)
    valid = key_pos < seq_lens[:, None]  # (nd, L)
    if sliding_window is not None:
        valid &= key_pos >= seq_lens[:, None] - sliding_window
    probs = scores.masked_fill(~valid[:, :, None, None], float("-inf")).softmax(dim=1)
    values = v_cache.view(-1, kv_heads, head_dim)[slots]  # (nd, L, kv_heads, head_dim), fused when compiled
    out = (probs.unsqueeze(-1) * values.unsqueeze(3).float()).sum(1)  # (nd, kv_heads, group, head_dim)
    return out.reshape(nd, num_heads, head_dim).to(q.dtype)


@torch.library.custom_op("glassbox::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    """The attention of layer ``layer_index`` as one op of the compiled graph (vLLM:
    ``unified_attention``): ``Attention.forward`` run eagerly with the forward context's
    metadata and cache. It writes the new K/V into the cache, which the graph does not see
    (the cache is not one of its tensors). Returns ``(num_tokens, num_heads * head_dim)``."""
    from engine.model.forward_context import get_forward_context

    ctx = get_forward_context()
    kv_cache = ctx.kv_caches[layer_index] if ctx.kv_caches else None
    with op_threads():  # the worker's thread count of the moment (engine/model/op_threads.py)
        return ctx.layers[layer_index](q, k, v, kv_cache, ctx.attn_metadata)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_compiled_paged_decode = None


def set_attention_backend(
    layers: list[Attention], backend: str, device: torch.device | str | None = None
) -> None:
    """Choose ``backend`` (one of ``ATTENTION_BACKENDS``) for ``layers``.

    ``PAGED_INDUCTOR`` compiles ``paged_decode_attention`` once for every batch (dynamic
    shapes; ``backed_size_oblivious`` so a batch of one decode makes no second graph). The
    first call compiles (seconds; cached on disk by Inductor), so call this before warm-up.
    ``CPU_PAGED_CPP`` builds the C++ kernel here (a second or two the first time; cached under
    ``<GLASSBOX_CACHE_ROOT>/kernels``), so no request pays for it.

    Raises:
        ValueError: an unknown backend; ``CPU_PAGED_CPP`` with a ``device`` (the model's,
            when the caller knows it) that is not the CPU.
        RuntimeError: ``CPU_PAGED_CPP`` and no C++ compiler, or its build failed.
    """
    global _compiled_paged_decode
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "PAGED_INDUCTOR" and _compiled_paged_decode is None:
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = True
        _compiled_paged_decode = torch.compile(paged_decode_attention, dynamic=True)
    if backend == "CPU_PAGED_CPP":
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"attention backend CPU_PAGED_CPP runs on the CPU only, and the model is on {device}: "
                "use --attention-backend TORCH_SDPA or PAGED_INDUCTOR"
            )
        load_kernel()
    for layer in layers:
        layer.backend = backend
        layer.decode_kernel = _compiled_paged_decode


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA; on CPU a bfloat16/float16 attention is computed in float32.

    Measured here: torch's CPU flash kernel is ~2.3x slower in bfloat16 than in float32 on
    this workload, while the casts cost little next to it (the matmuls stay in bfloat16).
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
