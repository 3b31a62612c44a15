"""Sampling parameters of one request.

Mirrors vLLM's ``vllm/sampling_params.py`` (``SamplingParams``): same field names and
defaults, validated when the object is built so a bad value fails in the caller's process
with a ``ValueError`` naming the field. Pure Python (no torch): it travels inside
``EngineCoreRequest`` and ``SchedulerOutput`` as a msgspec struct.

Left out: beam search, structured outputs, logits processors, ``best_of``, bad words.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

# Temperatures below this are treated as greedy (vLLM: ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
# Bounds that keep every value representable in the engine's int32/int64 tensors.
MAX_INT32 = 2**31 - 1
# Most completions per request (OpenAI's limit): each is a request in the engine.
MAX_N = 128
# vLLM's default --max-logprobs. The limit a request meets is the engine's
# ``ModelConfig.max_logprobs`` (checked by the input processor), not this constant.
MAX_LOGPROBS = 20


# The type each numeric field must have (bool excluded; a float must be finite, an int is
# accepted for it), and whether None is allowed.
_FIELD_TYPES: dict[str, tuple[type, bool]] = {
    "n": (int, False),
    "top_k": (int, False),
    "min_tokens": (int, False),
    "max_tokens": (int, True),
    "logprobs": (int, True),
    "prompt_logprobs": (int, True),
    "seed": (int, True),
    "presence_penalty": (float, False),
    "frequency_penalty": (float, False),
    "repetition_penalty": (float, False),
    "temperature": (float, False),
    "top_p": (float, False),
    "min_p": (float, False),
}


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick the next token, and when to stop.

    Greedy when ``temperature`` is 0. ``top_k`` of 0 or -1 disables top-k. ``stop`` strings
    are matched on detokenized text by the output processor; ``stop_token_ids``, EOS and the
    length limits are checked by the scheduler (``check_stop``).

    Raises:
        ValueError: on any out-of-range field; the message starts with the field name.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the input processor: stop_token_ids plus the model's extra EOS ids
    # (generation_config.json may list several, e.g. Llama-3-Instruct).
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    # How many characters the detokenizer must hold back so a stop string can never leak
    # partially into streamed text (longest stop string - 1, 0 when included in output).
    output_text_buffer_length: int = 0

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or ())
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other knobs cannot change the pick; normalise them as vLLM does.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        if self.top_k == -1:
            self.top_k = 0
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        if not self.all_stop_token_ids:
            self.all_stop_token_ids = list(self.stop_token_ids)

    def _verify_args(self) -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"{field} must be {allowed}, got {value!r}.")

        # Types first: a bool is not a count, and NaN/inf are not probabilities.
        for field, (kind, optional) in _FIELD_TYPES.items():
            value = getattr(self, field)
            if value is None and optional:
                continue
            number = kind is float and isinstance(value, (int, float)) and math.isfinite(value)
            if isinstance(value, bool) or not (number or (kind is int and isinstance(value, int))):
                raise bad(field, value, "an integer" if kind is int else "a finite number")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"between 1 and {MAX_N}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not -1 <= self.top_k <= MAX_INT32:
            raise bad("top_k", self.top_k, f"-1 or 0 (disabled) or between 1 and {MAX_INT32}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_INT32:
            raise bad("max_tokens", self.max_tokens, "at least 1")
        if not 0 <= self.min_tokens <= MAX_INT32:
            raise bad("min_tokens", self.min_tokens, "greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"less than or equal to max_tokens={self.max_tokens}")
        # The upper bound is the engine's --max-logprobs, checked by the input processor.
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_INT32:
            raise bad("logprobs", self.logprobs, "a non-negative integer")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_INT32:
            raise bad("prompt_logprobs", self.prompt_logprobs, "a non-negative integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        # Which ids exist is the vocabulary's question: the input processor's check.
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", self.seed, "a 64-bit integer")

    @property
    def sampling_type_greedy(self) -> bool:
        """True when the pick is the argmax (temperature below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None
    ) -> None:
        """Add the model's extra EOS ids (all but the primary one) to the stop ids.

        vLLM: ``SamplingParams.update_from_generation_config``. Called by the input
        processor; with ``ignore_eos`` nothing is added.
        """
        eos = generation_config.get("eos_token_id")
        if eos is None or self.ignore_eos:
            return
        eos_ids = [eos] if isinstance(eos, int) else list(eos)
        extra = [t for t in eos_ids if t != model_eos_token_id]
        merged = list(self.all_stop_token_ids or self.stop_token_ids)
        for t in extra:
            if t not in merged:
                merged.append(t)
        self.all_stop_token_ids = merged

    @classmethod
    def from_defaults(cls, defaults: dict[str, Any], **overrides: Any) -> SamplingParams:
        """vLLM's defaults, then ``defaults`` (the model's, from
        ``ModelConfig.get_diff_sampling_param()``), then ``overrides``.

        vLLM: ``SamplingParams.from_optional(**diff)`` in ``LLM.get_default_sampling_params``.
        ``do_sample`` in ``generation_config.json`` is ignored, as vLLM ignores it: a model
        whose file says ``do_sample: false`` still samples at temperature 1.0 unless a
        temperature is given.
        """
        return cls(**{**defaults, **overrides})

    def clone(self) -> SamplingParams:
        """A deep copy (used to fan out ``n`` child requests)."""
        return msgspec.structs.replace(
            self,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            all_stop_token_ids=list(self.all_stop_token_ids),
        )
