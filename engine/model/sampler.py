"""Turn one step's logits into next tokens (and logprobs), for the whole batch at once.

Mirrors vLLM's ``vllm/v1/sample/sampler.py`` (``Sampler``), ``metadata.py``
(``SamplingMetadata``), ``ops/penalties.py``, ``ops/topk_topp_sampler.py`` and the
min-tokens / min-p logits processors. The order is vLLM's:

1. raw logprobs (log-softmax of the untouched logits), only when some row asked;
2. min_tokens: rows with fewer than ``min_tokens`` outputs cannot pick a stop token;
3. penalties: repetition (prompt + output tokens), frequency and presence (outputs);
4. greedy rows take the argmax here and never touch the random path;
5. random rows: temperature → min-p → top-k → top-p → one draw from the softmax, using
   the "exponential race" ``argmax(p / q)`` with ``q ~ Exp(1)`` — a seeded row draws its
   ``q`` from its own ``torch.Generator``, so a seed gives the same tokens whatever else
   is in the batch;
6. logprobs of the sampled token and the top N, with the sampled token's rank.

Logits are float32 throughout. Each row is one request that samples this step.

Left out: allowed-token masks, bad words, logit bias, custom logits processors,
speculative decoding (rejection sampling), processed (post-penalty) logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step; row ``i`` is the ``i``-th request that samples.

    Tensors are ``(num_rows,)`` on the logits' device, or None when no row needs them
    (the sampler then skips that stage entirely).

    Attributes:
        temperature: float32; only read for random rows.
        all_greedy / all_random: every row is greedy / every row samples.
        random_rows: int64 indices of the rows that sample (None when ``all_greedy``);
            ``random_row_list`` the same on the host.
        top_k: int64, ``vocab_size`` for rows without top-k. top_p, min_p: float32.
        generators: row → the request's seeded ``torch.Generator``.
        max_num_logprobs: the largest ``logprobs`` asked by any row, or None.
        no_penalties: True when no row has a penalty (prompt/output tensors are then None).
        prompt_token_ids / output_token_ids: ``(num_rows, max_len)`` int64, padded with
            ``vocab_size``.
        presence_penalties / frequency_penalties / repetition_penalties: float32.
        min_tokens_stop_ids: row → token ids it may not pick yet (EOS and stop ids while
            it has fewer than ``min_tokens`` outputs).
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    random_rows: torch.Tensor | None = None
    random_row_list: list[int] = field(default_factory=list)
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    min_tokens_stop_ids: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        sampling_params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Gather the rows' settings into tensors. All sequences have one entry per row."""
        n = len(sampling_params)
        greedy = [p.temperature < SAMPLING_EPS for p in sampling_params]
        all_greedy, all_random = all(greedy), not any(greedy)
        meta = cls(temperature=None, all_greedy=all_greedy, all_random=all_random)
        asked = [p.logprobs for p in sampling_params if p.logprobs is not None]
        meta.max_num_logprobs = max(asked) if asked else None

        for row, params in enumerate(sampling_params):
            if params.min_tokens and len(output_token_ids[row]) < params.min_tokens:
                stop_ids = list(params.all_stop_token_ids)
                eos = eos_token_ids[row]
                if eos is not None and not params.ignore_eos:
                    stop_ids.append(eos)
                stop_ids = [t for t in stop_ids if 0 <= t < vocab_size]
                if stop_ids:
                    meta.min_tokens_stop_ids[row] = stop_ids

        if any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in sampling_params
        ):
            meta.no_penalties = False
            meta.prompt_token_ids = _pad(prompt_token_ids, vocab_size, device)
            meta.output_token_ids = _pad(output_token_ids, vocab_size, device)
            meta.presence_penalties = _floats([p.presence_penalty for p in sampling_params], device)
            meta.frequency_penalties = _floats([p.frequency_penalty for p in sampling_params], device)
            meta.repetition_penalties = _floats([p.repetition_penalty for p in sampling_params], device)

        if all_greedy:
            return meta
        meta.temperature = _floats([max(p.temperature, SAMPLING_EPS) for p in sampling_params], device)
        meta.random_row_list = [i for i in range(n) if not greedy[i]]
        meta.random_rows = torch.tensor(meta.random_row_list, dtype=torch.int64, device=device)
        if any(p.top_k > 0 for p in sampling_params):
            top_k = [p.top_k if p.top_k > 0 else vocab_size for p in sampling_params]
            meta.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in sampling_params):
            meta.top_p = _floats([p.top_p for p in sampling_params], device)
        if any(p.min_p > 0.0 for p in sampling_params):
            meta.min_p = _floats([p.min_p for p in sampling_params], device)
        meta.generators = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
        return meta


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``(num_rows, max_len)`` int64, each row padded with ``pad`` (an id past the vocabulary)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


@dataclass
class LogprobsTensors:
    """Logprob rows as tensors: the chosen token first, then the top N.

    ``token_ids`` and ``logprobs`` are ``(num_rows, N + 1)``; ``ranks`` is ``(num_rows,)``,
    the chosen token's rank (1 = most likely). vLLM: ``LogprobsTensors``.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """``sampled_token_ids`` ``(num_rows,)`` int64, and logprobs when any row asked."""

    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The logprob and rank of ``token_ids`` (num_rows,) plus the ``num_logprobs`` best of each row.

    ``logprobs`` is ``(num_rows, vocab)`` (a log-softmax).
    """
    token_ids = token_ids.long()[:, None]  # (num_rows, 1)
    chosen = logprobs.gather(-1, token_ids)  # (num_rows, 1)
    # Rank as vLLM counts it: how many entries are at least as likely as the chosen one.
    ranks = (logprobs >= chosen).sum(-1)  # (num_rows,)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # (num_rows, num_logprobs)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties; ``logits`` (num_rows, vocab) → same shape.

    Repetition (vLLM's rule, on prompt and output tokens): a seen token's logit is divided
    by the penalty when positive and multiplied when negative. Frequency subtracts
    ``penalty × count`` and presence ``penalty × [count > 0]``, counting output tokens only.
    """
    num_rows, vocab = logits.shape
    output_ids = meta.output_token_ids  # (num_rows, max_output_len), padded with vocab
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # (num_rows, vocab): how often each token was output
    in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, meta.prompt_token_ids, True)
    seen = in_prompt[:, :vocab] | (counts > 0)  # (num_rows, vocab)
    rep = meta.repetition_penalties[:, None]  # (num_rows, 1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency_penalties[:, None] * counts
    return logits - meta.presence_penalties[:, None] * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p × p_max`` of their row. (rows, vocab)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # (rows, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens, then its smallest set with mass ≥ ``top_p``.

    ``logits`` (rows, vocab); ``top_k`` int64 (rows,) (``vocab`` disables); ``top_p``
    float32 (rows,) (1.0 disables). The best token is always kept.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (rows, vocab)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # (1, vocab)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler(nn.Module):
    """Pick one token per row. ``forward(logits (rows, vocab) float32, metadata) -> SamplerOutput``."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.min_tokens_stop_ids:
            rows = [r for r, ids in meta.min_tokens_stop_ids.items() for _ in ids]
            cols = [t for ids in meta.min_tokens_stop_ids.values() for t in ids]
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits = logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows: argmax. Random rows: one draw after temperature/min-p/top-k/top-p. (rows,)."""
        # max(...).indices: the same first maximal index as argmax, 2.5-2.7x faster on a CPU
        # (torch 2.13: 0.16 against 0.44 ms for 32 rows of 8,192, one thread).
        greedy = logits.max(dim=-1).indices  # (rows,)
        if meta.all_greedy:
            return greedy
        rows = meta.random_rows
        pick = (lambda t: t) if meta.all_random else (lambda t: t[rows])
        x = pick(logits) / pick(meta.temperature)[:, None]  # (random_rows, vocab)
        if meta.min_p is not None:
            x = apply_min_p(x, pick(meta.min_p))
        x = apply_top_k_top_p(
            x,
            pick(meta.top_k) if meta.top_k is not None else None,
            pick(meta.top_p) if meta.top_p is not None else None,
        )
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs)
        if len(meta.generators) < probs.shape[0]:
            q.exponential_()
        if meta.generators:
            position = {row: j for j, row in enumerate(meta.random_row_list)}
            for row, generator in meta.generators.items():
                q[position[row]].exponential_(generator=generator)
        drawn = probs.div(q).max(dim=-1).indices  # (random_rows,)
        if meta.all_random:
            return drawn
        return greedy.index_copy(0, rows, drawn)
