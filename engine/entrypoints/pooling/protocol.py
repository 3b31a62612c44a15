"""Request and response bodies of ``/v1/embeddings`` and ``/pooling`` (pydantic models).

Mirrors vLLM 0.32's ``vllm/entrypoints/pooling/embed/protocol.py`` (``EmbeddingCompletionRequest``,
``EmbeddingResponse``, ``EmbeddingResponseData``), ``pooling/protocol.py``
(``PoolingCompletionRequest``, ``PoolingResponse``, ``PoolingResponseData``) and the mixins of
``base/protocol.py``: OpenAI's embeddings fields (``input``, ``model``, ``encoding_format``,
``dimensions``, ``user``) plus vLLM's extras (``use_activation``, ``add_special_tokens``,
``embed_dtype``, ``endianness``; ``task`` on ``/pooling``).

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists:
one embedding per prompt, ``data[i]`` for prompt ``i``. ``encoding_format``: ``float`` (a list
of numbers) or ``base64`` (the float32 bytes, as the ``openai`` client reads them).

Left out, a 400 naming the field: ``encoding_format`` ``bytes`` / ``bytes_only`` (binary
responses), ``embed_dtype`` other than ``float32``, ``endianness`` other than ``native``,
``truncate_prompt_tokens``, ``padding``, ``truncation_side``, chat-style inputs (``messages``),
and ``normalize`` (removed in vLLM 0.32: ``use_activation``).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import ConfigDict, Field

from engine.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo
from engine.pooling_params import PoolingParams


class PoolingRequestFields(OpenAIBaseModel):
    """What both pooling routes take (vLLM's ``PoolingBasicRequestMixin``,
    ``CompletionRequestMixin``, ``EncodingRequestMixin``, ``EmbedRequestMixin``)."""

    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    use_activation: bool | None = None
    add_special_tokens: bool = True
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native"] = "native"
    # Declared so that asking for them is a 400 (left out), not silently ignored.
    truncate_prompt_tokens: int | None = None
    padding: str | None = None
    truncation_side: str | None = None

    # Fields no model declares are kept, so the server can log them (and refuse `normalize`).
    model_config = ConfigDict(extra="allow")


class EmbeddingCompletionRequest(PoolingRequestFields):
    """``POST /v1/embeddings`` (OpenAI's body; vLLM's ``EmbeddingCompletionRequest``)."""

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", dimensions=self.dimensions, use_activation=self.use_activation)


class PoolingCompletionRequest(PoolingRequestFields):
    """``POST /pooling`` (vLLM's ``PoolingCompletionRequest``): the pooled vector of each
    prompt for ``task`` (the model's, ``embed``, when unset); ``use_activation: false`` gives
    the raw pooled hidden state, not normalised. ``dimensions`` is refused, as vLLM does."""

    task: str | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", use_activation=self.use_activation)


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


# The fields a pooling request may not use, and why (``ServingPoolingBase.check_pooling_fields``).
LEFT_OUT_FIELDS: dict[str, str] = {
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported (left out): send a prompt that fits.",
    "padding": "padding is not supported (left out).",
    "truncation_side": "truncation_side is not supported (left out).",
}
