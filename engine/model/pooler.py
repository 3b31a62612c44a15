"""The pooler: a pooling model's final hidden states → one vector per prompt.

Mirrors vLLM's ``vllm/model_executor/layers/pooler/`` (``Pooler``, ``SequencePooler``, the
sequence pooling methods ``CLSPool`` / ``LastPool`` / ``MeanPool``, ``EmbeddingPoolerHead``,
``pooler_for_embed``) and ``vllm/v1/pool/metadata.py`` (``PoolingMetadata``,
``PoolingCursor``), in one file. The idea: the model runner hands the pooler the step's flat
hidden states ``(num_tokens, hidden)`` and, per request, where its tokens of this step sit;
the pooling method picks or averages each request's rows, the head turns the result into the
embedding (float32; cut to ``dimensions``; normalised to unit length when ``use_activation``)::

    hidden (num_tokens, hidden) ──pooling──▶ (num_reqs, hidden) ──head──▶ num_reqs × (dims,)

Chunked prefill: a request whose prompt is split over several steps is pooled at every one,
but only the step that computes its last prompt token is *finished* (``finished_mask``), and
only that step's vector is kept. That is right for LAST pooling (the last chunk holds the last
token, which attended to the whole prompt through the KV cache); MEAN and CLS need every
prompt token in one step, so they refuse a partial prefill — the config schedules their
prompts whole (vLLM's rule: chunked prefill and prefix caching off for them).

Left out: token-wise pooling (``ALL``, ``STEP``), classification heads, Sentence
Transformers projection layers, and the list-or-tensor outputs of vLLM's head (ours always
returns one tensor per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.pooling_params import PoolingParams
from engine.tasks import PoolingTask


@dataclass
class PoolingCursor:
    """Where each request's tokens of this step sit in the flat batch (vLLM's ``PoolingCursor``).

    Attributes:
        first_token_indices: ``(num_reqs,)`` int64 on the device: each request's first row.
        last_token_indices: ``(num_reqs,)`` int64 on the device: each request's last row.
        prompt_lens: per request, its prompt length in tokens.
        seq_lens: per request, tokens in the KV cache after this step.
        num_scheduled_tokens: per request, tokens computed this step.
    """

    first_token_indices: torch.Tensor
    last_token_indices: torch.Tensor
    prompt_lens: list[int]
    seq_lens: list[int]
    num_scheduled_tokens: list[int]

    def is_partial_prefill(self) -> bool:
        """Whether some request computes only part of its prompt this step (a chunk, or the
        rest after a prefix-cache hit)."""
        return self.num_scheduled_tokens != self.prompt_lens

    def get_finished_mask(self) -> list[bool]:
        """Per request: its whole prompt is computed after this step (its vector is final)."""
        return [seq_len == prompt_len for seq_len, prompt_len in zip(self.seq_lens, self.prompt_lens)]


@dataclass
class PoolingMetadata:
    """What the pooler needs of the step's requests (vLLM's ``PoolingMetadata``).

    ``prompt_lens`` and ``pooling_params`` have one entry per request, in batch order;
    ``build_pooling_cursor`` adds where their tokens are.
    """

    prompt_lens: list[int]
    pooling_params: list[PoolingParams]
    pooling_cursor: PoolingCursor | None = None

    def build_pooling_cursor(
        self, num_scheduled_tokens: Sequence[int], seq_lens: Sequence[int], device: torch.device
    ) -> None:
        """Set ``pooling_cursor`` from the step's tokens per request (``num_scheduled_tokens``,
        batch order) and the requests' lengths after the step (``seq_lens``)."""
        starts = [0]
        for n in num_scheduled_tokens:
            starts.append(starts[-1] + n)
        cumsum = torch.tensor(starts, dtype=torch.int64, device=device)  # (num_reqs + 1,)
        self.pooling_cursor = PoolingCursor(
            first_token_indices=cumsum[:-1],
            last_token_indices=cumsum[1:] - 1,
            prompt_lens=list(self.prompt_lens),
            seq_lens=list(seq_lens),
            num_scheduled_tokens=list(num_scheduled_tokens),
        )

    def get_pooling_cursor(self) -> PoolingCursor:
        if self.pooling_cursor is None:
            raise RuntimeError("build_pooling_cursor() first")
        return self.pooling_cursor


# ------------------------------------------------------------------------------ methods


class SequencePoolingMethod(nn.Module, ABC):
    """Hidden states of a step → one row per request, ``(num_reqs, hidden)``."""

    @abstractmethod
    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        raise NotImplementedError


class CLSPool(SequencePoolingMethod):
    """The first token's hidden state (BERT's [CLS]; for a causal decoder it saw only itself)."""

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        cursor = metadata.get_pooling_cursor()
        if cursor.is_partial_prefill():
            raise RuntimeError("partial prefill is not supported with CLS pooling")
        return hidden_states[cursor.first_token_indices]  # (num_reqs, hidden)


class LastPool(SequencePoolingMethod):
    """The last token's hidden state: in a causal decoder, the one that attended to all the
    prompt (the default for converted decoders)."""

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        cursor = metadata.get_pooling_cursor()
        return hidden_states[cursor.last_token_indices]  # (num_reqs, hidden)


class MeanPool(SequencePoolingMethod):
    """The mean of the prompt's hidden states, summed in float32."""

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        cursor = metadata.get_pooling_cursor()
        if cursor.is_partial_prefill():
            raise RuntimeError("partial prefill is not supported with MEAN pooling")
        num_reqs, device = len(cursor.prompt_lens), hidden_states.device
        lens = torch.tensor(cursor.prompt_lens, dtype=torch.int64, device=device)  # (num_reqs,)
        # Each token's request: [2, 1, 3] → [0, 0, 1, 2, 2, 2].
        owner = torch.repeat_interleave(torch.arange(num_reqs, device=device), lens)  # (num_tokens,)
        sums = torch.zeros(num_reqs, hidden_states.shape[-1], dtype=torch.float32, device=device)
        sums.index_add_(0, owner, hidden_states[: owner.numel()].float())  # (num_reqs, hidden)
        return sums / lens.unsqueeze(1)


def get_seq_pooling_method(pooling_type: str) -> SequencePoolingMethod:
    """``"CLS"``, ``"LAST"`` or ``"MEAN"`` → its method.

    Raises:
        NotImplementedError: any other name.
    """
    methods = {"CLS": CLSPool, "LAST": LastPool, "MEAN": MeanPool}
    if pooling_type not in methods:
        raise NotImplementedError(f"unknown sequence pooling type {pooling_type!r}")
    return methods[pooling_type]()


# ------------------------------------------------------------------------------ head


class EmbeddingPoolerHead(nn.Module):
    """Pooled rows → embeddings (vLLM's ``EmbeddingPoolerHead``, without a projector): in
    ``head_dtype`` (float32, vLLM's default for pooling models), each cut to its request's
    ``dimensions`` (Matryoshka), then L2-normalised where ``use_activation`` (vLLM's
    ``PoolerNormalize``).

    Returns one 1-D tensor per request (their lengths differ when ``dimensions`` do).
    """

    def __init__(self, head_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.head_dtype = head_dtype

    def forward(self, pooled: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        pooled = pooled.to(self.head_dtype)  # (num_reqs, hidden)
        embeddings = []
        for row, params in zip(pooled, metadata.pooling_params):
            if params.dimensions is not None:
                row = row[: params.dimensions]  # (dimensions,)
            if params.use_activation:
                row = F.normalize(row, p=2, dim=-1)
            embeddings.append(row)
        return embeddings


# ------------------------------------------------------------------------------ poolers


class Pooler(nn.Module, ABC):
    """What a pooling model has in place of an LM head (vLLM's ``Pooler`` interface)."""

    @abstractmethod
    def get_supported_tasks(self) -> set[PoolingTask]:
        raise NotImplementedError

    @abstractmethod
    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        raise NotImplementedError


class SequencePooler(Pooler):
    """A pooling method, then a head: one vector per request (vLLM's ``SequencePooler``)."""

    def __init__(self, pooling: SequencePoolingMethod, head: EmbeddingPoolerHead) -> None:
        super().__init__()
        self.pooling = pooling
        self.head = head

    def get_supported_tasks(self) -> set[PoolingTask]:
        return {"embed"}

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``hidden_states`` ``(num_tokens, hidden)`` of one step → one embedding per request."""
        return self.head(self.pooling(hidden_states, metadata), metadata)


def pooler_for_embed(seq_pooling_type: str) -> SequencePooler:
    """The pooler of an embedding model (vLLM's ``pooler_for_embed``): the config's pooling
    method and a float32, normalising head."""
    return SequencePooler(get_seq_pooling_method(seq_pooling_type), EmbeddingPoolerHead())
