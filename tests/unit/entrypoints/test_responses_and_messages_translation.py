"""What ``/v1/responses`` and ``/v1/messages`` make of a request before the chat flow runs it,
and the pieces of their answers that are pure functions.

Checked: the conversation each request stands for (instructions first and not carried over,
the previous response's answer as an assistant turn, text parts and blocks as chat text
parts), the chat request's fields (``max_output_tokens`` / ``max_tokens`` as the output limit,
``text.format`` and ``output_config.format`` as chat's ``response_format``), the refusals of
what is left out naming the field, the bounded store (least recently used forgotten, a
retrieval counting as a use, a background run pushed out cancelled), the stop-reason mapping,
and the error shapes by path.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from engine.entrypoints.anthropic import serving as anthropic
from engine.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from engine.entrypoints.openai.responses.protocol import (
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
)
from engine.entrypoints.openai.responses.serving import (
    ResponsesStore,
    StoredResponse,
    check_supported,
    construct_input_messages,
    to_chat_completion_request,
)
from engine.entrypoints.openai.serving_engine import OpenAIError, error_body

USER_X = [{"role": "user", "content": "x"}]

# ---------------------------------------------------------------------------- Responses


def test_instructions_come_first_and_are_not_carried_over_from_the_previous_response() -> None:
    previous = [{"role": "system", "content": "Old rules."}, {"role": "user", "content": "Hi"}]
    answer = [
        ResponseOutputMessage(id="msg_1", status="completed", content=[ResponseOutputText(text="Hello!")])
    ]
    messages = construct_input_messages("New rules.", "And now?", previous, answer)
    assert messages == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And now?"},
    ]


def test_message_items_keep_their_roles_and_text_parts() -> None:
    request = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "developer", "content": "Terse."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
            ]
        }  # fmt: skip
    )
    assert construct_input_messages(None, request.input) == [
        {"role": "developer", "content": "Terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]


def test_the_chat_request_carries_the_limit_the_sampling_fields_and_text_format() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    request = ResponsesRequest.model_validate(
        {
            "input": "x",
            "max_output_tokens": 7,
            "temperature": 0,
            "top_k": 3,
            "stop": ["."],
            "stream": True,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
        }  # fmt: skip
    )
    chat = to_chat_completion_request(request, USER_X)
    assert (chat.max_completion_tokens, chat.temperature, chat.top_k, chat.stop, chat.stream) == (
        7,
        0,
        3,
        ["."],
        True,
    )
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema, "strict": True},
    }
    json_object = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert to_chat_completion_request(json_object, USER_X).response_format.model_dump(exclude_none=True) == {
        "type": "json_object"
    }
    text = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "text"}}})
    assert to_chat_completion_request(text, USER_X).response_format is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True, "stream": True}, "background"),
        ({"background": True, "store": False}, "background"),
    ],
)
def test_what_is_left_out_is_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        check_supported(ResponsesRequest.model_validate({"input": "x", **body}), store_enabled=True)
    assert (err.value.status_code, err.value.param) == (400, param)


def test_background_needs_the_servers_store() -> None:
    with pytest.raises(OpenAIError) as err:
        check_supported(
            ResponsesRequest.model_validate({"input": "x", "background": True}), store_enabled=False
        )
    assert err.value.param == "background"


def test_an_input_item_that_is_not_a_message_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as err:
        ResponsesRequest.model_validate({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]})
    (error,) = err.value.errors()
    assert error["loc"] == ("input",) and "'function_call'" in error["msg"]


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse(
        ResponsesResponse(id=response_id, status="completed", model="m", temperature=0, top_p=1), []
    )


def test_the_store_forgets_the_least_recently_used_response_past_its_bound() -> None:
    store = ResponsesStore(2)
    store.put(_stored("a"))
    store.put(_stored("b"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_stored("c"))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a") is not None and store.get("c") is not None


def test_a_store_of_size_0_keeps_nothing() -> None:
    store = ResponsesStore(0)
    store.put(_stored("a"))
    assert store.get("a") is None


def test_a_background_run_pushed_out_of_the_store_is_cancelled() -> None:
    async def scenario() -> bool:
        store = ResponsesStore(1)
        running = _stored("a")
        running.task = asyncio.create_task(asyncio.sleep(60))
        store.put(running)
        store.put(_stored("b"))
        await asyncio.gather(running.task, return_exceptions=True)
        return running.task.cancelled()

    assert asyncio.run(scenario())


# ---------------------------------------------------------------------------- Anthropic


def _anthropic(**body) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body})


def test_system_blocks_join_and_text_blocks_become_chat_text_parts() -> None:
    request = _anthropic(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "c"}],  # fmt: skip
        stop_sequences=["\n\n"], temperature=0, top_p=0.5, top_k=4, stream=True,
    )  # fmt: skip
    chat = anthropic.to_chat_completion_request(request)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
    ]
    assert (chat.max_completion_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.stream) == (
        5, ["\n\n"], 0, 0.5, 4, True)  # fmt: skip


def test_output_config_format_becomes_chats_response_format() -> None:
    schema = {"type": "object"}
    request = _anthropic(messages=[{"role": "user", "content": "x"}],
                         output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    assert anthropic.to_chat_completion_request(request).response_format.model_dump(
        by_alias=True, exclude_none=True
    ) == {
        "type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({"system": [{"type": "document"}], "messages": [{"role": "user", "content": "x"}]}, "system"),
    ],
)
def test_a_block_that_is_not_text_is_a_400_naming_where_it_is(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        anthropic.to_chat_completion_request(_anthropic(**body))
    assert (err.value.param, "left out" in err.value.message) == (param, True)


@pytest.mark.parametrize("where", ["messages", "system"])
def test_a_text_block_without_its_text_is_a_400_saying_so(where: str) -> None:
    blocks = [{"type": "text"}]
    body = {"messages": [{"role": "user", "content": blocks}]} if where == "messages" else {
        "system": blocks, "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
    with pytest.raises(OpenAIError) as err:
        anthropic.to_chat_completion_request(_anthropic(**body))
    assert (err.value.param, err.value.message) == (
        where, "A text content block needs its 'text' field (a string).")  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
        ({"tool_choice": {"type": "auto"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ],
)
def test_anthropic_features_left_out_are_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        anthropic.check_supported(_anthropic(messages=[{"role": "user", "content": "x"}], **body))
    assert err.value.param == param
    anthropic.check_supported(
        _anthropic(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"})
    )


def test_max_tokens_is_required_and_positive() -> None:
    for body in ({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                 {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}):  # fmt: skip
        with pytest.raises(ValidationError) as err:
            AnthropicMessagesRequest.model_validate(body)
        assert err.value.errors()[0]["loc"] == ("max_tokens",)


@pytest.mark.parametrize(
    "finish_reason, stop_reason, expected",
    [
        ("length", None, ("max_tokens", None)),
        ("stop", "\n\n", ("stop_sequence", "\n\n")),
        ("stop", None, ("end_turn", None)),  # EOS
        ("stop", 2, ("end_turn", None)),  # a stop token id is no stop sequence
        ("abort", None, (None, None)),
    ],
)
def test_the_engines_finish_maps_to_anthropics_stop_reason(finish_reason, stop_reason, expected) -> None:
    assert anthropic.to_anthropic_stop_reason(finish_reason, stop_reason) == expected


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "status, err_type",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (405, "invalid_request_error"),
        (503, "api_error"),
    ],  # fmt: skip
)
def test_errors_under_v1_messages_take_anthropics_shape(status: int, err_type: str) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = error_body(path, status, "no").model_dump()
        assert body == {"type": "error", "error": {"type": err_type, "message": "no"}}
    for path in ("/v1/chat/completions", "/v1/messagesX", "/v1/responses"):
        assert set(error_body(path, status, "no", "f").model_dump()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def test_a_renamed_error_names_the_routes_own_field() -> None:
    error = OpenAIError("too large", 400, "max_completion_tokens").renamed(
        {"max_completion_tokens": "max_tokens"}
    )
    assert (error.message, error.status_code, error.param) == ("too large", 400, "max_tokens")
    assert OpenAIError("x", 404, "model").renamed({"messages": "input"}).param == "model"
