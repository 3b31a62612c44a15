"""A user's prompt and params → a validated ``EngineCoreRequest``, in the frontend.

Mirrors vLLM's ``vllm/v1/engine/input_processor.py`` (``InputProcessor``; ``Processor`` in
0.11). Everything that can be wrong with a request is found here, in the caller's process,
and raised as a ``ValueError`` (HTTP 400 in the API server) — before the engine core sees
it. The checks and messages follow vLLM's ``_validate_model_input``.

What it does, in order: tokenize a text prompt (with the tokenizer's special tokens, so a
BOS is added when the tokenizer adds one); reject an empty prompt, a prompt that leaves no
room for one output token and out-of-vocabulary ids (``validate_prompt``, the one prompt
rule, for ``LLM`` and the API server alike); reject ``stop_token_ids`` outside the vocabulary and
stop strings that are not valid Unicode; copy the params and fill in what the engine needs:
``max_tokens`` (all the room left when unset, clamped to it when larger) and the model's
extra EOS ids from ``generation_config.json``.

``logprobs`` / ``prompt_logprobs`` above ``--max-logprobs`` are refused here too
(``validate_params``).

A pooling request (``PoolingParams``, ``--runner pooling``) takes the same path with the
pooling rule for its prompt — up to ``max_model_len`` tokens, since no output token follows
(vLLM lets embeddings use the whole context) — and ``PoolingParams.verify`` for its params;
a generation request on a pooling model, or the reverse, is refused ("This model does not
support generation" / "pooling", vLLM's words). The API server builds its engine requests here, before a stream
answers 200, so a bad request is a plain 400 and every rule is checked once.

Structured outputs: a request's constraint is compile-checked here with the engine's
compiler (``_validate_structured_output``), so a bad one never reaches the engine.

Left out: multimodal inputs, encoder-decoder prompts, LoRA,
``n`` fan-out (done by the caller with ``ParentRequest``).
"""

from __future__ import annotations

import operator
import time
from typing import Any

from engine.config import ModelConfig, StructuredOutputsConfig
from engine.core.messages import EngineCoreRequest
from engine.frontend.outputs import PromptType
from engine.frontend.tokenizer import encode
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


def validate_prompt(
    prompt_token_ids: list[int], max_model_len: int, vocab_size: int, pooling: bool = False
) -> None:
    """The one rule every prompt meets, from ``LLM`` and the API server alike.

    A generation needs ``len(prompt) < max_model_len``: the prompt plus at least one output
    token must fit (vLLM's ``_validate_model_input`` and its serving layer's
    ``_validate_input`` refuse a prompt of exactly ``max_model_len`` the same way). A pooling
    request (``pooling``) makes no output token: its prompt may fill the context,
    ``len(prompt) <= max_model_len`` (vLLM's rule for embeddings). The length is checked
    before the ids, so a huge prompt costs no scan.

    Args:
        prompt_token_ids: the prompt, in tokens.
        max_model_len: the context length, in tokens (prompt + output).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        pooling: the pooling rule instead of the generation rule.

    Raises:
        ValueError: the prompt is empty, leaves no room for output or (pooling) is longer
            than the context (vLLM's "maximum context length" wording), or holds an id
            outside the vocabulary.
    """
    if not prompt_token_ids:
        raise ValueError("The decoder prompt cannot be empty.")
    if pooling and len(prompt_token_ids) > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {len(prompt_token_ids)} input tokens. Please reduce the length of the input."
        )
    if not pooling and len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {len(prompt_token_ids)} input tokens, which leaves no room for output. "
            "Please reduce the length of the input prompt."
        )
    for token_id in prompt_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"Token id {token_id!r} is out of vocabulary (vocab_size={vocab_size}).")


class InputProcessor:
    """Tokenizes and validates requests (vLLM's ``InputProcessor``).

    Args:
        model_config: gives ``max_model_len``, ``vocab_size``, the EOS ids and
            ``generation_config``.
        tokenizer: the model's ``PreTrainedTokenizerFast``.
        data_parallel_size: the engines a request may pin with ``data_parallel_rank``
            (the parallel config's; vLLM's ``InputProcessor`` reads it there too).
        structured_outputs_config: ``--structured-outputs-config`` (its JSON options are the
            defaults a request's constraint is validated with).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        data_parallel_size: int = 1,
        structured_outputs_config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, built on first use
        self.tokenizer = tokenizer
        self.data_parallel_size = data_parallel_size
        # The primary EOS is the tokenizer's, as in vLLM (for chat models it is the
        # end-of-turn token); config.json's is the fallback.
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = model_config.eos_token_id
        # Without a generation_config.json vLLM derives one from config.json, so
        # config.json's EOS ids still stop generation.
        self.generation_config = dict(model_config.generation_config)
        if self.generation_config.get("eos_token_id") is None:
            eos = model_config.hf_config.get("eos_token_id")
            if eos is not None:
                self.generation_config["eos_token_id"] = eos
        # The most logprobs a request may ask for (--max-logprobs; -1: the vocabulary).
        self.max_logprobs = model_config.max_logprobs
        if self.max_logprobs == -1:
            self.max_logprobs = model_config.vocab_size

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        data_parallel_rank: int | None = None,
    ) -> EngineCoreRequest:
        """Build the engine request for one prompt.

        Args:
            request_id: unique id of the request.
            prompt: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
            params: the user's sampling params, or a pooling request's ``PoolingParams``;
                never modified (a copy is filled in).
            arrival_time: wall-clock seconds (``time.time()``); now when None.
            priority: lower runs first under the priority scheduling policy.
            trace_headers: W3C trace context to carry to the engine.
            tokenization_kwargs: extra arguments for ``tokenizer.encode`` — e.g.
                ``{"add_special_tokens": False}`` for text a chat template rendered.
            data_parallel_rank: the engine to run on (``0 .. data_parallel_size - 1``);
                None lets the client's load balancer choose.

        Returns:
            The ``EngineCoreRequest``. The prompt text for ``OutputProcessor.add_request``
            is the caller's: the string itself, ``prompt["prompt"]``, or None for token ids.

        Raises:
            ValueError: the prompt is not one of the three shapes, or breaks
                ``validate_prompt`` (empty, no room for output, an id outside the vocabulary);
                ``stop`` strings are asked for with ``detokenize=False`` or are not valid
                Unicode (a lone surrogate); a ``stop_token_ids`` id is outside the vocabulary;
                ``data_parallel_rank`` is not one of the engines; params of a kind the model
                does not serve; bad pooling params (``PoolingParams.verify``).
        """
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is out of range [0, {self.data_parallel_size})."
            )
        self._validate_supported_task(params)
        prompt_token_ids = self._tokenize(prompt, tokenization_kwargs or {})
        pooling = isinstance(params, PoolingParams)
        validate_prompt(
            prompt_token_ids, self.model_config.max_model_len, self.model_config.vocab_size, pooling
        )
        if pooling:
            params = params.clone()
            params.verify(self.model_config)
            return EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=None,
                pooling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time if arrival_time is not None else time.time(),
                priority=priority,
                trace_headers=trace_headers,
                data_parallel_rank=data_parallel_rank,
            )
        self.validate_params(params)

        params = params.clone()
        # All the room left when unset, and no more than it when set: at least 1, as
        # validate_prompt leaves room for one token (vLLM's serving layer: get_max_tokens).
        room = self.model_config.max_model_len - len(prompt_token_ids)
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.update_from_generation_config(self.generation_config, self.eos_token_id)

        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            trace_headers=trace_headers,
            data_parallel_rank=data_parallel_rank,
        )

    def _validate_supported_task(self, params: SamplingParams | PoolingParams) -> None:
        """A generation request needs a generating model, a pooling request a pooling one
        (vLLM's ``_validate_params``).

        Raises:
            ValueError: the other kind, naming the runner that would serve it.
            TypeError: ``params`` is neither.
        """
        tasks = self.model_config.supported_tasks
        if isinstance(params, SamplingParams):
            if "generate" not in tasks:
                raise ValueError("This model does not support generation: it runs with --runner pooling.")
        elif isinstance(params, PoolingParams):
            if "embed" not in tasks:
                raise ValueError("This model does not support pooling: it runs with --runner generate.")
        else:
            raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")

    def _tokenize(self, prompt: PromptType, tokenization_kwargs: dict[str, Any]) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            try:  # numpy integers are fine too
                return [operator.index(t) for t in prompt["prompt_token_ids"]]
            except TypeError:
                raise ValueError(
                    f"prompt_token_ids must be integers, got {prompt['prompt_token_ids']!r:.80}"
                ) from None
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            return encode(self.tokenizer, text, **tokenization_kwargs)
        raise ValueError(
            'a prompt must be a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}, '
            f"got {type(prompt).__name__}"
        )

    def validate_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: it knows neither the vocabulary, nor
        ``--max-logprobs`` (-1: the vocabulary; vLLM's ``_validate_logprobs``), nor that its
        strings must cross to the engine core as UTF-8. ``process_inputs`` calls it.

        Raises:
            ValueError: the message starts with the field's name (the API server turns that
                into the error's ``param``).
        """
        if params.stop:
            _validate_stop_strings(params)
        vocab_size = self.model_config.vocab_size
        for token_id in params.stop_token_ids or ():
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"stop_token_ids holds token id {token_id!r}, which is out of vocabulary "
                    f"(vocab_size={vocab_size})"
                )
        if params.structured_outputs is not None:
            self._validate_structured_output(params)
        limit = self.max_logprobs
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(params, field)
            if value is not None and value > limit:
                raise ValueError(f"{field} must be between 0 and {limit} (--max-logprobs), got {value}.")

    def _validate_structured_output(self, params: SamplingParams) -> None:
        """Compile-check the request's constraint with the engine's own compiler, here in the
        API server, so a bad schema, regex or grammar is a 400 before the request reaches the
        engine (vLLM's ``_validate_structured_output``).

        Raises:
            ValueError: ``"structured_outputs.<kind>: <why>"``.
        """
        from engine.core.structured_output.backend_guidance import (
            ll_tokenizer_from,
            validate_guidance_grammar,
        )

        if self._ll_tokenizer is None:
            eos = self.generation_config.get("eos_token_id")
            eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
            eos_ids += [t for t in ([eos] if isinstance(eos, int) else eos or []) if t not in eos_ids]
            self._ll_tokenizer = ll_tokenizer_from(
                self.tokenizer.backend_tokenizer.to_str(), self.model_config.vocab_size, eos_ids
            )
        config = self.structured_outputs_config
        validate_guidance_grammar(
            params.structured_outputs,
            self._ll_tokenizer,
            disable_any_whitespace=config.disable_any_whitespace,
            disable_additional_properties=config.disable_additional_properties,
            whitespace_pattern=config.whitespace_pattern,
        )


def _validate_stop_strings(params: SamplingParams) -> None:
    """Stop strings are matched on detokenized text, and cross to the engine core as UTF-8."""
    if not params.detokenize:
        raise ValueError("stop strings need detokenized text: set detokenize=True or drop stop")
    for stop_str in params.stop:
        try:
            stop_str.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"stop strings must be valid Unicode text: {stop_str!r} holds a lone surrogate "
                f"at position {e.start}"
            ) from None
