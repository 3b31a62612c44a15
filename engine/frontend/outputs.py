"""What a user gets back: ``RequestOutput`` and its ``CompletionOutput``s, ``PoolingRequestOutput``
(a pooling model's vector) and ``EmbeddingRequestOutput``, and prompt types.

Mirrors vLLM's ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``,
``PoolingRequestOutput``, ``PoolingOutput``, ``EmbeddingRequestOutput``, ``EmbeddingOutput``),
``vllm/logprobs.py`` (``Logprob``), ``vllm/inputs/data.py`` (``TextPrompt``,
``TokensPrompt``, ``PromptType``), with the same names and fields. ``RequestOutput.metrics``
is the request's ``RequestStateStats`` (``engine/metrics/stats.py``). Plain dataclasses:
these objects live in the user's (or the API server's) process only and never cross a
process boundary.

Deliberate deviation: ``PoolingOutput.data`` is a numpy float32 array, where vLLM's is a
torch tensor: this module lives in the API server, which never imports torch (``tolist()``
and ``shape`` read the same).

Left out: classification and scoring outputs, LoRA, multimodal fields, KV-transfer params,
encoder-decoder prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypedDict, TypeVar

import numpy as np

if TYPE_CHECKING:
    from engine.metrics.stats import RequestStateStats


class TextPrompt(TypedDict):
    """A prompt as text; the input processor tokenizes it (``{"prompt": "Hello"}``)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt already tokenized (``{"prompt_token_ids": [1, 15043]}``); used as is."""

    prompt_token_ids: list[int]


# A bare string is the same as ``TextPrompt(prompt=...)``.
PromptType = str | TextPrompt | TokensPrompt


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the model's raw distribution.
        rank: 1 for the most likely token of the vocabulary, 2 for the next, ...
        decoded_token: the token decoded on its own (a piece of a multi-byte character
            shows as U+FFFD), or None when the request has ``detokenize=False``.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id → Logprob (the chosen token plus the top-N).
LogprobsDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` > 1 gives several, by ``index``).

    Attributes:
        index: which of the request's ``n`` samples this is (0-based).
        text: the generated text (with DELTA output: only the text new since the last
            output). A matched stop string is cut off unless ``include_stop_str_in_output``.
        token_ids: generated token ids (DELTA: only the new ones). A stop string does not
            cut tokens: the token that completed it stays.
        cumulative_logprob: sum of the sampled tokens' logprobs; None unless
            ``logprobs`` was requested.
        logprobs: one dict per generated token (DELTA: per new token), or None.
        finish_reason: None while running, then "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended the request; None when
            it ended on EOS or on length.
        text_offsets: per generated token (DELTA: per new token), the character offset
            where its text starts in the whole text (before a stop-string cut; at or past
            the end for a token cut off), as the detokenizer recorded it; None unless
            ``logprobs`` was requested. The legacy completions API's
            ``logprobs.text_offset``; not in vLLM (its serving layer derives the offsets).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offsets: list[int] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything a request produced so far (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the id the user's request carries (the parent id when ``n`` > 1).
        prompt: the prompt text, or None when the prompt was given as token ids.
        prompt_token_ids: the prompt as the engine saw it.
        prompt_logprobs: one entry per prompt position, the first None (the first token
            has nothing before it to be predicted from); None unless ``prompt_logprobs``
            was requested. DELTA outputs carry each position once.
        outputs: the completions, sorted by ``index``.
        finished: True in the last output of the request.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: the request's ``RequestStateStats`` (timings), when the output processor
            was built with ``log_stats``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one.

        Used by a consumer that falls behind (vLLM: ``RequestOutputCollector``): with
        ``aggregate`` (DELTA outputs) text, tokens and logprobs are appended; otherwise
        (CUMULATIVE) each completion is replaced by its newer version.
        """
        self.finished |= next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics
        if next_output.prompt_logprobs:
            if aggregate and self.prompt_logprobs:
                self.prompt_logprobs = self.prompt_logprobs + next_output.prompt_logprobs
            else:
                self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                old.text += new.text
                old.token_ids = old.token_ids + new.token_ids
                if new.logprobs is not None:
                    old.logprobs = (old.logprobs or []) + new.logprobs
                if new.text_offsets is not None:
                    old.text_offsets = (old.text_offsets or []) + new.text_offsets
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason = new.finish_reason
                old.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)


@dataclass
class PoolingOutput:
    """What a pooling model made of one prompt (vLLM's ``PoolingOutput``).

    Attributes:
        data: the pooled vector, float32 ``(embedding_size,)`` or ``(dimensions,)``;
            normalised unless the request's ``use_activation`` was false.
    """

    data: np.ndarray


@dataclass
class EmbeddingOutput:
    """One prompt's embedding as a list of floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        """Raises ValueError: the pooled data is not one vector."""
        if pooling_output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(pooling_output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


_O = TypeVar("_O", PoolingOutput, EmbeddingOutput)


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """A pooling request's result (vLLM's ``PoolingRequestOutput``): one output, at the end.

    Attributes:
        request_id: the id the user's request carries.
        outputs: its ``PoolingOutput`` (an ``EmbeddingOutput`` for ``EmbeddingRequestOutput``).
        prompt_token_ids: the prompt as the engine saw it.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finished: always True (a pooling request has no partial output).
        metrics: the request's ``RequestStateStats``, when the output processor keeps them.
    """

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    metrics: RequestStateStats | None = None


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s result: the embedding as a list of floats (vLLM's name)."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=request_output.request_id,
            outputs=EmbeddingOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            num_cached_tokens=request_output.num_cached_tokens,
            finished=request_output.finished,
            metrics=request_output.metrics,
        )
