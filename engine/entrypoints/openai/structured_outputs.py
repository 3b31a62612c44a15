"""A request's output constraint, from whichever field asked for it, and tool calls from the output.

Three fields can constrain a reply, as in vLLM: vLLM's own ``structured_outputs``, OpenAI's
``response_format`` (``json_object``, ``json_schema``) and, on chat, ``tools`` with a
``tool_choice`` of ``"required"`` or a named function. ``structured_outputs_of`` turns the one
given into ``StructuredOutputsParams`` (the engine's) and says which request field each of its
parts came from, so a schema that does not compile is a 400 naming
``response_format.json_schema.schema`` or ``tools[1].function.parameters``, not an internal
name. ``tool_calls_of`` turns a constrained reply back into ``tool_calls``.

Mirrors what vLLM spreads over ``ChatCompletionRequest.to_sampling_params`` /
``_get_json_schema_from_tool`` (``vllm/entrypoints/openai/protocol.py``) and the tool-choice
branches of ``OpenAIServingChat``. Left out: ``tool_choice: "auto"`` (it needs a tool parser,
``--enable-auto-tool-choice``, which Glassbox does not have), the structural tag.
"""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
)
from engine.entrypoints.openai.serving_engine import OpenAIError, random_uuid
from engine.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def structured_outputs_of(request: Any) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The request's constraint, and ``renames``: ``structured_outputs.<kind>`` → the request
    field it came from (for ``bad_request_from_value_error``).

    Raises:
        OpenAIError: (400) two fields constrain the reply; ``tool_choice`` is ``"auto"`` (or
            left unset with ``tools``); a named tool that is not in ``tools``; a
            ``json_schema`` response format without a schema; ``structured_outputs`` with
            none or several constraints.
    """
    found: list[tuple[str, StructuredOutputsParams, dict[str, str]]] = []
    if request.structured_outputs is not None:
        for left_out in ("structural_tag", "disable_fallback"):
            if getattr(request.structured_outputs, left_out) is not None:
                raise OpenAIError(f"structured_outputs.{left_out} is not supported (left out).",
                                  param=f"structured_outputs.{left_out}")  # fmt: skip
        fields = request.structured_outputs.model_dump(
            by_alias=True, exclude_none=True, exclude={"structural_tag", "disable_fallback"}
        )
        try:
            params = StructuredOutputsParams(**fields)
        except ValueError as e:
            raise OpenAIError(str(e), param="structured_outputs") from None
        found.append(("structured_outputs", params, {}))
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True),
                          {"structured_outputs.json_object": "response_format"}))  # fmt: skip
        else:
            json_schema = response_format.json_schema
            if json_schema is None or json_schema.json_schema is None:
                raise OpenAIError(
                    'response_format of type "json_schema" needs json_schema.schema.',
                    param="response_format.json_schema",
                )
            found.append(("response_format", StructuredOutputsParams(json=json_schema.json_schema),
                          {"structured_outputs.json": "response_format.json_schema.schema"}))  # fmt: skip
    if isinstance(request, ChatCompletionRequest):
        tool_constraint = _tool_constraint(request)
        if tool_constraint is not None:
            found.append(tool_constraint)
    if len(found) > 1:
        raise OpenAIError(
            f"Only one of structured_outputs, response_format and tool_choice may constrain the reply; "
            f"got {', '.join(name for name, _, _ in found)}.",
            param=found[1][0],
        )
    if not found:
        return None, {}
    _, params, renames = found[0]
    return params, renames


def _tool_constraint(
    request: ChatCompletionRequest,
) -> tuple[str, StructuredOutputsParams, dict[str, str]] | None:
    """``tools`` + ``tool_choice`` as a JSON schema: a named tool's arguments, or for
    ``"required"`` a non-empty array of ``{"name", "parameters"}`` calls of any tool."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise OpenAIError(f"tool_choice {_choice_name(choice)} needs tools.", param="tools")
    if choice == "auto":
        raise OpenAIError(
            'tool_choice "auto" (the default when tools are given) needs a tool parser, which Glassbox '
            'leaves out: use tool_choice "required" or {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        name = choice.function.name
        index = next((i for i, tool in enumerate(tools) if tool.function.name == name), None)
        if index is None:
            raise OpenAIError(
                f"tool_choice names {name!r}, which is not one of the tools.", param="tool_choice"
            )
        schema = tools[index].function.parameters or ANY_OBJECT
        return (
            "tool_choice",
            StructuredOutputsParams(json=schema),
            {"structured_outputs.json": f"tools[{index}].function.parameters"},
        )
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": tool.function.parameters or ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                }
                for tool in tools
            ],
        },
    }
    return "tool_choice", StructuredOutputsParams(json=calls), {"structured_outputs.json": "tools"}


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def random_tool_call_id() -> str:
    """vLLM's tool call id: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{random_uuid()}"


def tool_calls_of(request: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The reply's tool calls when ``tool_choice`` asked for them, else None.

    A named tool: one call, whose arguments are the whole reply. ``"required"``: the reply is
    the JSON array of ``{"name", "parameters"}``; None when it does not parse (a reply cut by
    ``max_tokens``: the text is then returned as content).
    """
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return [
            ToolCall(
                id=random_tool_call_id(), function=FunctionCall(name=choice.function.name, arguments=text)
            )
        ]
    try:
        calls = json.loads(text)
        return [
            ToolCall(
                id=random_tool_call_id(),
                function=FunctionCall(
                    name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)
                ),
            )
            for call in calls
        ]
    except (ValueError, TypeError, KeyError):
        return None
