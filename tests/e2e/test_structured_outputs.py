"""Structured outputs end to end: ``glassbox serve`` on its defaults and the official ``openai`` client.

One server for the module (the bundled tiny model, no flags). What a user checks: a
``response_format`` JSON-schema reply always parses and validates against its schema, for
several schemas, with no ``max_tokens`` (the tiny model rambles: the engine's budget-aware
completion closes the document before the room runs out); ``structured_outputs`` regex and
choice replies match; a named tool and ``tool_choice: "required"`` come back as
``tool_calls``; a schema, regex or grammar that does not compile is a 400 naming the field;
``/metrics`` counts the grammar compiles.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_utils import Server, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "score", "color", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["id", "email"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
            "minItems": 1,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["customer", "lines", "paid"],
}
FLAT = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Describe it as JSON."}]


@pytest.fixture(scope="module")
def server():
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    srv = start_server(base, "--uvicorn-log-level", "warning")
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=240)


def model(srv: Server) -> str:
    return client(srv).models.list().data[0].id


def test_json_schema_replies_always_parse_and_validate(server):
    """Several schemas at once, each twice, sampled at the default temperature, no max_tokens."""
    aclient = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=240
    )
    name = model(server)
    schemas = [("person", PERSON), ("order", ORDER), ("flat", FLAT)] * 2

    async def ask(title: str, schema: dict):
        return await aclient.chat.completions.create(
            model=name,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": title, "schema": schema, "strict": True},
            },
        )

    async def ask_all():
        return await asyncio.gather(*(ask(title, schema) for title, schema in schemas))

    replies = asyncio.run(ask_all())
    for (title, schema), reply in zip(schemas, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (title, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert reply.usage.completion_tokens < 2048 - reply.usage.prompt_tokens  # ended inside the room


def test_json_object_and_a_streamed_schema_reply(server):
    c, name = client(server), model(server)
    reply = c.chat.completions.create(
        model=name, messages=ASK, response_format={"type": "json_object"}, max_tokens=64
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = c.chat.completions.create(
        model=name, messages=ASK, max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "flat", "schema": FLAT}},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), FLAT)


def test_regex_and_choice_through_structured_outputs(server):
    c, name = client(server), model(server)
    phone = c.completions.create(model=name, prompt="Call me at", max_tokens=20,
                                 extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{4}", phone.choices[0].text)
    answer = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Yes or no?"}],
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})  # fmt: skip
    assert answer.choices[0].message.content in ("yes", "no", "maybe")
    assert answer.choices[0].finish_reason == "stop"


def test_a_named_tool_and_required_tools_come_back_as_tool_calls(server):
    c, name = client(server), model(server)
    weather = WEATHER["function"]["parameters"]
    named = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    [call] = choice.message.tool_calls
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and call.id.startswith("chatcmpl-tool-")
    )
    jsonschema.validate(json.loads(call.function.arguments), weather)

    required = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What time is it?"}], tools=[TIME, WEATHER],
        tool_choice="required",
    )  # fmt: skip
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_time", "get_weather")
        schema = weather if call.function.name == "get_weather" else TIME["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto", the default with tools: no tool parser
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[1].function.parameters"),
    ],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field(server, body, param):
    for stream in (False, True):
        response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                              json={"messages": ASK, "stream": stream, **body})  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "BadRequestError", error


def test_the_responses_and_messages_routes_hold_their_format_too(server):
    """``/v1/responses``' ``text.format`` and ``/v1/messages``' ``output_config.format`` become
    chat's ``response_format``: the same path, and their errors name their own fields."""
    fmt = {"type": "json_schema", "name": "flat", "schema": FLAT}
    name = model(server)
    response = httpx.post(f"{server.base_url}/v1/responses", timeout=120,
                          json={"model": name, "input": "A title, as JSON.", "text": {"format": fmt}})  # fmt: skip
    assert response.status_code == 200, response.text
    text = response.json()["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), FLAT)
    message = httpx.post(f"{server.base_url}/v1/messages", timeout=120,
                         json={"model": name, "max_tokens": 200, "messages": [{"role": "user", "content": "A title?"}],
                               "output_config": {"format": {"type": "json_schema", "schema": FLAT}}})  # fmt: skip
    assert message.status_code == 200, message.text
    jsonschema.validate(json.loads(message.json()["content"][0]["text"]), FLAT)
    bad = httpx.post(f"{server.base_url}/v1/messages", timeout=60,
                     json={"model": name, "max_tokens": 20, "messages": [{"role": "user", "content": "A title?"}],
                           "output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}})  # fmt: skip
    assert bad.status_code == 400 and "output_config.format.schema" in bad.text, bad.text


def test_metrics_count_the_grammar_compiles(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    count = next(
        line
        for line in text.splitlines()
        if line.startswith("glassbox:structured_output_compile_seconds_count")
    )
    assert float(count.rsplit(" ", 1)[1]) >= 10  # every request above that reached the engine
    waiting = next(
        line for line in text.splitlines() if line.startswith("glassbox:num_requests_waiting_for_grammar")
    )
    assert waiting.endswith(" 0.0")
