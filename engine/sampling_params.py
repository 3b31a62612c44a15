"""Sampling parameters of one request.

Mirrors vLLM's ``vllm/sampling_params.py`` (``SamplingParams``): same field names and
defaults, validated when the object is built so a bad value fails in the caller's process
with a ``ValueError`` naming the field. Pure Python (no torch): it travels inside
``EngineCoreRequest`` and ``SchedulerOutput`` as a msgspec struct.

``StructuredOutputsParams`` (vLLM's, in the same file) constrains the output to a JSON schema,
a regular expression, a list of choices or a grammar; it rides inside ``SamplingParams``
(``structured_outputs``) to the engine core, whose ``StructuredOutputManager`` compiles it.

Left out: beam search, logits processors, ``best_of``, bad words; of structured outputs, the
structural tag, ``disable_fallback`` (one backend: nothing to fall back to) and a per-request
backend.
"""

from __future__ import annotations

import copy
import enum
import json
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


# The range of each numeric field, checked in this order once the types are right (None,
# where allowed, is in range): (low, high, whether low itself is out, what the message says
# the field must be). logprobs' real upper bound is the engine's --max-logprobs, checked by
# the input processor.
_FIELD_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "n": (1, MAX_N, False, f"between 1 and {MAX_N}"),
    "presence_penalty": (-2.0, 2.0, False, "in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, False, "in [-2, 2]"),
    "repetition_penalty": (0.0, 2.0, True, "in (0, 2]"),
    "temperature": (0.0, math.inf, False, "non-negative"),
    "top_p": (0.0, 1.0, True, "in (0, 1]"),
    "top_k": (-1, MAX_INT32, False, f"-1 or 0 (disabled) or between 1 and {MAX_INT32}"),
    "min_p": (0.0, 1.0, False, "in [0, 1]"),
    "max_tokens": (1, MAX_INT32, False, "at least 1"),
    "min_tokens": (0, MAX_INT32, False, "greater than or equal to 0"),
    "logprobs": (0, MAX_INT32, False, "a non-negative integer"),
    "prompt_logprobs": (0, MAX_INT32, False, "a non-negative integer"),
    "seed": (-(2**63), 2**63 - 1, False, "a 64-bit integer"),
}


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One output constraint (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text; a dict is kept as its text) the
      output must validate against;
    - ``json_object``: any JSON object;
    - ``regex``: a regular expression (Rust ``regex`` syntax, as llguidance reads it) the
      whole output must match;
    - ``choice``: the output is one of these strings;
    - ``grammar``: a Lark or GBNF grammar.

    ``disable_any_whitespace`` (compact JSON), ``disable_additional_properties`` (an object
    schema without ``additionalProperties`` takes no keys beyond its ``properties``) and
    ``whitespace_pattern`` (a regex for the whitespace JSON may hold) tune the JSON grammar;
    left None they take ``--structured-outputs-config``'s values.

    Raises:
        ValueError: none or several constraints, or a value of the wrong shape; the message
            starts with ``structured_outputs``. Whether a schema, regex or grammar compiles is
            the input processor's check (``validate_structured_output``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or json_object, "
                f"got {', '.join(given) if given else 'none'}."
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if isinstance(self.json, dict):
            # A schema travels to the engine core as its JSON text: msgpack holds no integer
            # beyond 64 bits, and a schema may ("minimum": -1e26 written as an integer) —
            # as a dict it failed the request's encoding with a 500 instead of compiling.
            self.json = json.dumps(self.json)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


# The constraints a StructuredOutputsParams may carry (exactly one of them).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
    # The output's constraint (a JSON schema, regex, choice or grammar), or None.
    structured_outputs: StructuredOutputsParams | None = None
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
        for field, (low, high, low_open, allowed) in _FIELD_RANGES.items():
            value = getattr(self, field)
            if value is not None and not (low < value <= high if low_open else low <= value <= high):
                raise bad(field, value, allowed)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"less than or equal to max_tokens={self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        # Which ids exist is the vocabulary's question: the input processor's check.
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids")

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
        merged = list(self.all_stop_token_ids or self.stop_token_ids)
        # Each id once, in the file's order (dict keys keep it).
        eos_ids = dict.fromkeys([eos] if isinstance(eos, int) else eos)
        merged += [t for t in eos_ids if t != model_eos_token_id and t not in merged]
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
        """A deep copy (used to fan out ``n`` child requests), as vLLM's ``clone``."""
        return copy.deepcopy(self)
