"""The StructuredOutputManager and the llguidance backend, on the bundled model's tokenizer.

Real grammars throughout: each test compiles through the manager's thread pool, reads the
bitmask rows it builds, and feeds tokens back as the scheduler would. The "model" is an
adversarial rambler (``rambling_pick``): of the tokens a row allows it takes one that never
closes anything while it can — the worst case for an output that must end inside
``max_tokens`` — so the budget-aware completion plan is what makes every output parse.
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import msgspec
import numpy as np
import pytest

from engine.config import DEFAULT_MODEL, StructuredOutputsConfig
from engine.core.engine_core import tokenizer_json
from engine.core.structured_output import StructuredOutputManager
from engine.core.structured_output.backend_guidance import GuidanceGrammar, validate_guidance_grammar
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.sched.request import Request, RequestStatus

VOCAB = 4096
EOS_IDS = [0, 2]
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"}},
        "required": ["name", "age", "score"],
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string"}},
                "required": ["id", "email"],
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "minLength": 3}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
            },
        },
        "required": ["user", "items"],
    },
}


@pytest.fixture(scope="module")
def manager():
    manager = StructuredOutputManager(
        StructuredOutputsConfig(),
        functools.partial(tokenizer_json, DEFAULT_MODEL),
        VOCAB,
        EOS_IDS,
        max_num_seqs=8,
    )
    yield manager
    manager.clear_backend()


def compiled(
    manager: StructuredOutputManager, params: StructuredOutputsParams, max_tokens: int = 64
) -> Request:
    request = Request(f"r{random.random()}", [5, 6, 7], SamplingParams(max_tokens=max_tokens,
                      structured_outputs=params), eos_token_id=0)  # fmt: skip
    assert request.status == RequestStatus.WAITING_FOR_FSM
    manager.grammar_init(request)
    request.structured_output_request._grammar.result(timeout=30)
    assert isinstance(request.structured_output_request.grammar, GuidanceGrammar)
    return request


def allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:VOCAB])]


def rambling_pick(manager: StructuredOutputManager, tokens: list[int], rng: random.Random) -> int:
    """A token that closes nothing (no quote, bracket or EOS) when one is allowed."""
    table = manager.backend.table
    open_ended = [t for t in tokens if t not in EOS_IDS and not set(table.token_bytes[t]) & set(b'"}]')]
    return rng.choice(open_ended or tokens)


def generate(manager: StructuredOutputManager, request: Request, seed: int = 0) -> tuple[bytes, bool]:
    """Step the request as scheduler + worker would; returns (output bytes, ended with EOS)."""
    rng = random.Random(seed)
    grammar = request.structured_output_request.grammar
    out = b""
    while request.num_output_tokens < request.max_tokens:
        row = manager.grammar_bitmask({request.request_id: request}, [request.request_id])[0]
        token = rambling_pick(manager, allowed(row), rng)
        assert grammar.accept_tokens(request.request_id, [token])
        request.append_output_token_ids(token)
        if token in EOS_IDS:
            return out, True
        out += manager.backend.table.token_bytes[token]
    return out, False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_rambling_model_still_ends_in_a_valid_document(manager, name):
    schema = SCHEMAS[name]
    for seed in range(2):
        request = compiled(manager, StructuredOutputsParams(json=schema), max_tokens=96)
        out, ended = generate(manager, request, seed)
        assert ended, f"no EOS within max_tokens: {out!r}"
        jsonschema.validate(json.loads(out), schema)
        assert request.structured_output_request.grammar.is_terminated()


def test_the_plan_starts_only_when_the_budget_gets_short(manager):
    request = compiled(manager, StructuredOutputsParams(json=SCHEMAS["flat"]), max_tokens=1000)
    grammar = request.structured_output_request.grammar
    # The shortest whole output: {"name":"","age":0,"score":0} in so many tokens.
    assert 10 <= grammar.shortest_output <= 30
    assert grammar.reserve == 2 * grammar.shortest_output + 8
    bitmask = manager.backend.allocate_token_bitmask(1)
    grammar.fill_bitmask(bitmask, 0, remaining_tokens=1000)
    assert [manager.backend.table.token_bytes[t] for t in allowed(bitmask[0])] == [b"{"]
    assert grammar.accept_tokens(request.request_id, allowed(bitmask[0]))
    grammar.fill_bitmask(bitmask, 0, remaining_tokens=999)
    assert grammar.planned is None and len(allowed(bitmask[0])) > 1
    grammar.fill_bitmask(bitmask, 0, remaining_tokens=grammar.reserve)
    assert grammar.planned is not None and len(allowed(bitmask[0])) == 1


def test_the_first_row_allows_only_what_can_open_the_document(manager):
    request = compiled(manager, StructuredOutputsParams(json=SCHEMAS["flat"]))
    tokens = allowed(manager.grammar_bitmask({request.request_id: request}, [request.request_id])[0])
    table = manager.backend.table
    assert tokens and all(table.token_bytes[t].lstrip(b" \t\n\r")[:1] in (b"{", b"") for t in tokens)


@pytest.mark.parametrize(
    ("params", "check"),
    [
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]{2,4}"), lambda text: text[:3].isdigit() and text[3] == "-"),
        (StructuredOutputsParams(choice=["alpha", "beta"]), lambda text: text in ("alpha", "beta")),
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
        (StructuredOutputsParams(grammar='start: "(" word ")"\nword: /[a-z]+/'),
         lambda text: text.startswith("(") and text.endswith(")")),
    ],
)  # fmt: skip
def test_regex_choice_object_and_grammar_outputs_end_inside_their_constraint(manager, params, check):
    request = compiled(manager, params, max_tokens=40)
    out, ended = generate(manager, request)
    assert ended and check(out.decode()), out


def test_a_repeated_schema_reuses_the_compiled_grammar_but_not_its_state(manager):
    first = compiled(manager, StructuredOutputsParams(json=SCHEMAS["nested"]), max_tokens=96)
    out, ended = generate(manager, first)
    assert ended
    second = compiled(manager, StructuredOutputsParams(json=SCHEMAS["nested"]), max_tokens=96)
    grammar = second.structured_output_request.grammar
    assert grammar.matcher is not first.structured_output_request.grammar.matcher
    assert grammar.shortest_output == first.structured_output_request.grammar.shortest_output
    assert not grammar.is_terminated() and grammar.output_bytes == b""  # it starts at the start
    out2, ended = generate(manager, second, seed=1)
    assert ended
    jsonschema.validate(json.loads(out2), SCHEMAS["nested"])


def test_compile_times_are_kept_for_the_metrics(manager):
    manager.take_compile_times()
    compiled(manager, StructuredOutputsParams(regex="[0-9]+"))
    times = manager.take_compile_times()
    assert len(times) == 1 and 0 < times[0] < 30
    assert manager.take_compile_times() == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StructuredOutputsParams(json='{"type": "object", "properties": '), "structured_outputs.json"),
        (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_validation_names_the_field_and_says_why(params, field):
    with pytest.raises(ValueError) as e:
        validate_guidance_grammar(params)
    assert str(e.value).startswith(f"{field}: ") and len(str(e.value)) > len(field) + 2


def test_a_schema_with_an_integer_beyond_64_bits_crosses_the_wire_and_compiles():
    # Found by schemathesis on /v1/responses: a schema holding -116304161851260587078582272
    # could not be msgpack-encoded for the engine core, and the request was a 500.
    schema = {"type": "string", "examples": [-116304161851260587078582272]}
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert json.loads(wire.structured_outputs.json) == schema
    validate_guidance_grammar(wire.structured_outputs)
    # Where the grammar cannot take the number, the grammar says so: a 400 naming the field.
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*integer"):
        validate_guidance_grammar(StructuredOutputsParams(json={"type": "integer", "minimum": -(2**90)}))


def test_params_carry_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
