"""The llguidance backend: JSON schemas, regexes, choices and grammars as token masks.

Mirrors vLLM's ``vllm/v1/structured_output/backend_guidance.py`` (``GuidanceBackend``,
``GuidanceGrammar``, ``serialize_guidance_grammar``, ``validate_guidance_grammar``).
llguidance compiles a constraint into an ``LLMatcher`` over the tokenizer's vocabulary; the
matcher fills one bitmask row per step and consumes each sampled token.

Why llguidance (vLLM's other choice is xgrammar; see pyproject.toml): its wheel has no
dependency, it imports no torch (so the API server validates schemas with the very compiler
the engine uses), and it computes masks on the CPU.

Glassbox's addition is the budget-aware completion (``completion.py``): once a request's
remaining ``max_tokens`` gets short, the grammar plans the shortest way to an accepting state
and the mask allows only that way, so the output always parses (given ``max_tokens`` of at
least the grammar's shortest whole output).

Left out: the structural tag, reasoning parsers, speculative decoding (rollback, draft
tokens), Mistral tokenizers.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict, deque
from typing import Any

import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np

from engine.core.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from engine.core.structured_output.completion import TokenTable, plan_completion, reserve_tokens
from engine.logger import init_logger
from engine.sampling_params import StructuredOutputsParams

logger = init_logger(__name__)

# Compiled constraints kept for reuse (each a matcher at the start of the output).
GRAMMAR_CACHE_SIZE = 128
# A request whose completion plan was not found tries again at its next steps, at most this
# many times in all (a search costs up to a few ms; the state changes a little each step).
MAX_PLAN_ATTEMPTS = 2
# Bits 0..31 of each bitmask word, to unpack a row into token ids.
_BITS = np.arange(32, dtype=np.uint32)


def get_structured_output_key(params: StructuredOutputsParams) -> tuple[StructuredOutputOptions, str]:
    """(kind, specification as text) of a request's constraint (vLLM's name)."""
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputOptions.JSON, spec
    if kind == "json_object":
        return StructuredOutputOptions.JSON_OBJECT, ""
    if kind == "regex":
        return StructuredOutputOptions.REGEX, params.regex or ""
    if kind == "choice":
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice)
    return StructuredOutputOptions.GRAMMAR, params.grammar or ""


def _without_additional_properties(schema: Any) -> Any:
    """A copy where every object schema with ``properties`` and no ``additionalProperties``
    takes no other keys (vLLM's ``disable_additional_properties``)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def serialize_guidance_grammar(
    request_type: StructuredOutputOptions,
    grammar_spec: str,
    disable_any_whitespace: bool = False,
    disable_additional_properties: bool = False,
    whitespace_pattern: str | None = None,
) -> str:
    """The llguidance grammar (its JSON text) for one constraint.

    Raises:
        ValueError: a JSON schema that is not JSON, a choice that is not a list of strings,
            a grammar that is neither Lark nor GBNF.
    """
    if request_type in (StructuredOutputOptions.JSON, StructuredOutputOptions.JSON_OBJECT):
        schema: Any = {"type": "object"} if request_type is StructuredOutputOptions.JSON_OBJECT else None
        if schema is None:
            try:
                schema = json.loads(grammar_spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        if disable_additional_properties:
            schema = _without_additional_properties(schema)
        options: dict[str, Any] = {"whitespace_flexible": not disable_any_whitespace}
        if whitespace_pattern is not None:
            options["whitespace_pattern"] = whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    kind = {
        StructuredOutputOptions.REGEX: "regex",
        StructuredOutputOptions.CHOICE: "choice",
        StructuredOutputOptions.GRAMMAR: "grammar",
    }[request_type]
    return llguidance.grammar_from(kind, grammar_spec)


def validate_guidance_grammar(
    params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None = None, **defaults: Any
) -> None:
    """Compile-check a request's constraint without building a matcher (vLLM's name): the
    API server's check, with the compiler the engine core uses.

    Raises:
        ValueError: ``"<field>: <why>"``, the field being ``structured_outputs.json``,
            ``.regex``, ``.choice`` or ``.grammar`` (the serving layer renames it to the
            request's own field, e.g. ``response_format.json_schema.schema``).
    """
    request_type, spec = get_structured_output_key(params)
    field = f"structured_outputs.{params.kind}"
    try:
        grammar = serialize_guidance_grammar(request_type, spec, **_options(params, defaults))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{field}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"{field}: {error}")


def _options(params: StructuredOutputsParams, defaults: dict[str, Any]) -> dict[str, Any]:
    """The JSON grammar options: the request's, else ``--structured-outputs-config``'s."""
    out = {}
    for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"):
        value = getattr(params, name)
        out[name] = defaults.get(name) if value is None else value
    return {k: v for k, v in out.items() if v is not None}


def ll_tokenizer_from(
    tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (``tokenizer.json``'s text), its
    vocabulary padded to the model's ``vocab_size`` (ids past the tokenizer's are never allowed)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)


def _deque_or_none(plan: list[int] | None) -> deque[int] | None:
    return None if plan is None else deque(plan)


def _allow(bitmask: np.ndarray, index: int, token: int) -> None:
    """Set token ``token``'s bit in row ``index``."""
    word = np.uint32(bitmask[index, token >> 5]) | np.uint32(1 << (token & 31))
    bitmask[index, token >> 5] = word.view(np.int32)


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's ``LLMatcher``, and its planned completion once the budget is short.

    Args:
        matcher: the compiled matcher, at the start of the output.
        backend: the backend (tokenizer, token table).
        shortest_output: tokens of the shortest whole output (``plan_completion`` from the
            start), None when none was found; sets when completion planning starts.
    """

    def __init__(self, matcher: llguidance.LLMatcher, backend: GuidanceBackend, shortest_output: int | None):
        self.matcher = matcher
        self.backend = backend
        self.shortest_output = shortest_output
        self.reserve = reserve_tokens(shortest_output)
        self.output_bytes = b""
        # The planned completion still to come (token ids), once planning started.
        self.planned: deque[int] | None = None
        self.plan_attempts = 0
        self._error: str | None = None
        self.terminated = False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by ``tokens``. An EOS id where the output may end terminates the grammar
        (as vLLM's; the scheduler's ``check_stop`` ends the request on it)."""
        for token in tokens:
            if self.terminated:
                return True
            if token in self.backend.eos_token_ids and self.matcher.is_accepting():
                self.terminated = True
                return True
            if not self.matcher.consume_token(token):
                self._error = self.matcher.get_error() or f"token {token} is not allowed here"
                logger.warning("%s: its grammar refused a token: %s", request_id, self._error)
                return False
            self.output_bytes += self.backend.table.token_bytes[token]
            if self.planned:
                if self.planned[0] == token:
                    self.planned.popleft()
                else:  # cannot happen while the mask allows only the planned token
                    self.planned = None
        return True

    def fill_bitmask(self, bitmask: np.ndarray, index: int, remaining_tokens: int) -> None:
        if (
            self.planned is None
            and remaining_tokens <= self.reserve
            and self.plan_attempts < MAX_PLAN_ATTEMPTS
        ):
            self.plan_attempts += 1
            self.planned = _deque_or_none(
                plan_completion(
                    self.matcher, self.backend.table, self.backend.allowed_tokens, self.output_bytes,
                    remaining_tokens - 1,  # and one token for EOS
                )
            )  # fmt: skip
        if self.planned is not None:
            # Following the plan; once it is done the output is complete: EOS only.
            bitmask[index].fill(0)
            for token in [self.planned[0]] if self.planned else self.backend.eos_token_ids:
                _allow(bitmask, index, token)
            return
        # llguidance allows only EOS once the matcher stopped (or is in an error state).
        llguidance_numpy.fill_next_token_bitmask(self.matcher, bitmask, index)
        if self.matcher.is_error():
            self._error = self.matcher.get_error()
        elif not bitmask[index].any():
            self._error = "no token is allowed next"

    def is_terminated(self) -> bool:
        return self.terminated

    def error(self) -> str | None:
        return self._error


class GuidanceBackend(StructuredOutputBackend):
    """Compiles constraints with llguidance for one tokenizer (vLLM's ``GuidanceBackend``).

    Args:
        tokenizer_json: the model's ``tokenizer.json`` text.
        vocab_size: the model's vocabulary (rows of the logits; may exceed the tokenizer's).
        eos_token_ids: the ids that end an output (the model's EOS ids).
        config: ``--structured-outputs-config`` (``disable_any_whitespace``, ...).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], config: Any) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.config = config
        self.ll_tokenizer = ll_tokenizer_from(tokenizer_json, vocab_size, eos_token_ids)
        # Compiled matchers by constraint (LRU): a repeated schema costs a copy, not a compile
        # (vLLM's xgrammar backend keeps such a cache; its guidance backend compiles each time).
        self._cache: OrderedDict[tuple, tuple[llguidance.LLMatcher, int | None]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.table = TokenTable(
            [
                b"" if i in self.eos_token_ids or self.ll_tokenizer.is_special_token(i)
                else self.ll_tokenizer.decode_bytes([i])
                for i in range(vocab_size)
            ]
        )  # fmt: skip

    def allowed_tokens(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The token ids ``matcher`` allows next (int64, ascending)."""
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)  # (ceil(vocab / 32),)
        return np.flatnonzero((words[:, None] >> _BITS) & 1)[: self.vocab_size]

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str, params=None):
        """A fresh ``GuidanceGrammar`` for one request: a copy of the compiled matcher (from the
        cache of the last ``GRAMMAR_CACHE_SIZE`` constraints, else compiled now, with its
        shortest whole output planned once).

        Raises:
            ValueError: the constraint does not compile (llguidance's message).
        """
        defaults = {
            "disable_any_whitespace": self.config.disable_any_whitespace,
            "disable_additional_properties": self.config.disable_additional_properties,
            "whitespace_pattern": self.config.whitespace_pattern,
        }
        options = (
            _options(params, defaults)
            if params is not None
            else {k: v for k, v in defaults.items() if v is not None}
        )
        key = (request_type, grammar_spec, tuple(sorted(options.items())))
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            serialized = serialize_guidance_grammar(request_type, grammar_spec, **options)
            matcher = llguidance.LLMatcher(self.ll_tokenizer, serialized, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            plan = plan_completion(matcher, self.table, self.allowed_tokens, b"", 256)
            cached = (matcher, None if plan is None else len(plan))
            with self._cache_lock:
                self._cache[key] = cached
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        template, shortest_output = cached
        return GuidanceGrammar(template.deep_copy(), self, shortest_output)
