"""The two attention backends that read decodes' K/V in place: ``PAGED_INDUCTOR`` and
``CPU_PAGED_CPP``.

Both subclass the reference ``AttentionImpl`` (``engine/model/attention.py``, ``TORCH_SDPA``)
and replace only ``forward_decode``: cache writes and prefill chunks (compute-bound; the
gather is a small part of them) are the reference's.

- ``PAGED_INDUCTOR``: ``paged_decode_attention`` is written as plain torch ops over
  ``cache[slots]``; compiled by Inductor, the indexing is fused into the dot products and the
  weighted sum, so no dense copy of the K/V is ever made and a bfloat16 cache is never cast as
  a whole (each element is widened in a register). It reads ``decode_slots`` (each decode's
  cache slots, padded to the longest), which the model runner builds for this backend only.
- ``CPU_PAGED_CPP`` (CPU only; the default on a CPU where the kernel builds, chosen by the
  model runner): decodes go to a hand-written C++ kernel (``csrc/paged_attention_cpu.cpp``,
  built with g++ at start-up and called through ctypes; ``paged_attention_cpu.py``) that
  walks each request's block table and reads K/V rows in place, one OpenMP task per request
  (all its KV heads, page by page) when there are two or more per thread, else per (request,
  KV head); all query heads of a KV head together — vLLM's CPU ``paged_attention_v1``.

vLLM counterpart: ``vllm/v1/attention/backends/cpu_attn.py`` (its CPU backend, whose decodes
call ``paged_attention_v1``); ``PAGED_INDUCTOR`` has none (vLLM's kernels are hand-written).
"""

from __future__ import annotations

import torch

from engine.model.attention import AttentionBackend, AttentionImpl, AttentionMetadata, KVCache
from engine.model.cpu.paged_attention_cpu import load_kernel, paged_decode_attention_cpu


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
    by Inductor (``PagedInductorBackend.prepare``) it becomes a load inside the reduction
    loops: this is what "paged attention" means — vLLM's ``paged_attention_v1`` kernels do the
    same in C++.
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


_compiled_paged_decode = None  # paged_decode_attention through torch.compile, made once a process


class PagedInductorImpl(AttentionImpl):
    """Decodes through the compiled ``paged_decode_attention``, reading ``decode_slots``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_kernel = _compiled_paged_decode

    def forward_decode(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_slots is None:  # not built (a caller that knows no PAGED_INDUCTOR)
            return super().forward_decode(q, kv_cache, meta)
        return self.decode_kernel(
            q, kv_cache[0], kv_cache[1], meta.decode_slots, meta.seq_lens[: q.shape[0]],
            self.scale, self.sliding_window,
        )  # fmt: skip


class PagedInductorBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "PAGED_INDUCTOR"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return PagedInductorImpl

    @classmethod
    def prepare(cls, device: torch.device | str | None) -> None:
        """Compile ``paged_decode_attention`` once for every batch (dynamic shapes;
        ``backed_size_oblivious`` so a batch of one decode makes no second graph). The call
        that first runs it compiles (seconds; cached on disk by Inductor)."""
        global _compiled_paged_decode
        if _compiled_paged_decode is None:
            import torch.fx.experimental._config as fx_config

            fx_config.backed_size_oblivious = True
            _compiled_paged_decode = torch.compile(paged_decode_attention, dynamic=True)


class CPUPagedCppImpl(AttentionImpl):
    """Decodes through the C++ kernel, which follows each decode's block table in place."""

    def forward_decode(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        return paged_decode_attention_cpu(
            q, kv_cache[0], kv_cache[1], meta.block_table[:nd], meta.seq_lens[:nd],
            self.scale, self.sliding_window,
        )  # fmt: skip


class CPUPagedCppBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_PAGED_CPP"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CPUPagedCppImpl

    @classmethod
    def prepare(cls, device: torch.device | str | None) -> None:
        """Build the C++ kernel (a second or two the first time; cached under
        ``<GLASSBOX_CACHE_ROOT>/kernels``), so no request pays for it.

        Raises:
            ValueError: ``device`` (the model's, when the caller knows it) is not the CPU.
            RuntimeError: no C++ compiler, or its build failed.
        """
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"attention backend CPU_PAGED_CPP runs on the CPU only, and the model is on {device}: "
                "use --attention-backend TORCH_SDPA or PAGED_INDUCTOR"
            )
        load_kernel()
