"""OpenAI's tool-calling shapes in a chat request: `tools`, `tool_choice`, and the tool calls of an assistant message
in the history. Unknown keys inside them are refused (a 400 naming them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_TOOLS = 128  # OpenAI's bound
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDefinition(_Closed):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # `required` and named calls are enforced either way; `auto` ones are parsed


class Tool(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Closed):
    name: str = Field(min_length=1)


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
CHOICES = ("none", "auto", "required")


class FunctionCall(_Closed):
    name: str = Field(min_length=1)  # need not be one of `tools`: the tools offered may change between turns
    arguments: str  # JSON text, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, v: str) -> str:
        try:
            json.loads(v)
        except ValueError as e:
            raise ValueError(f"must be valid JSON (the arguments of an earlier call, as returned), not {v[:40]!r} "
                             f"({e})") from None
        return v


class ToolCall(_Closed):
    """A call in an assistant message of the history, as a response returned it."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class ToolFields(BaseModel):
    """The request fields of tool calling (a mixin of ChatCompletionRequest)."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the deprecated functions API: declared so that sending it is a 400 that says to send tools instead
    functions: Any = None
    function_call: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, v: Any) -> Any:
        """One error naming tool_choice (or the key inside it), not one per shape of the union."""
        if v is None or v in CHOICES:
            return v
        if not isinstance(v, dict):
            raise ValueError(f"must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}")
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def with_tool_fields(message: dict[str, Any], tool_calls: list[ToolCall] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """A history message as chat templates read it: tool calls' arguments as objects where they are JSON (templates
    write them with `tojson`), the tool_call_id of a tool result."""
    if tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_tool_message(role: str, tool_calls: list[ToolCall] | None, tool_call_id: str | None) -> None:
    if tool_calls is not None and role != "assistant":
        raise ValueError("tool_calls: only an assistant message carries tool calls")
    if role == "tool" and not tool_call_id:
        raise ValueError("tool_call_id: required in a tool message (the id of the call it answers)")
    if tool_call_id is not None and role != "tool":
        raise ValueError("tool_call_id: only a tool message answers a tool call")


class HistoryMessage(Protocol):
    role: str
    tool_calls: list[ToolCall] | None
    tool_call_id: str | None


def check_tool_history(messages: Sequence[HistoryMessage]) -> None:
    """Each tool message answers a call of the assistant message that comes before it, with only tool messages
    between them, and each call of an assistant message that more messages follow is answered (as OpenAI checks:
    a 400 otherwise, naming the message's field)."""
    open_calls: set[str] | None = None  # the calls the tool messages here may answer; None: no assistant call
    caller = 0  # the index of the assistant message that made open_calls
    unanswered: list[str] = []  # its calls no tool message has answered yet, in its order
    for i, message in enumerate(messages):
        if message.role != "tool":
            _all_answered(caller, unanswered)
        if message.role == "assistant":
            open_calls = {c.id for c in message.tool_calls} if message.tool_calls else None
            caller, unanswered = i, [c.id for c in message.tool_calls or []]
            if i == len(messages) - 1:  # the last message: its calls are answered in a later request
                unanswered = []
        elif message.role != "tool":
            open_calls = None
        elif open_calls is None:
            raise ValueError(f"messages.{i}.role: a message with role `tool` must answer a tool call of the assistant "
                             "message before it (no assistant message with tool_calls comes before it)")
        elif message.tool_call_id not in open_calls:
            raise ValueError(f"messages.{i}.tool_call_id: `{message.tool_call_id}` is not among the tool_calls of the "
                             f"assistant message before it ({', '.join(sorted(open_calls))})")
        else:
            unanswered = [c for c in unanswered if c != message.tool_call_id]
    _all_answered(caller, unanswered)


def _all_answered(caller: int, unanswered: list[str]) -> None:
    if unanswered:
        raise ValueError(f"messages.{caller}.role: an assistant message with tool_calls must be followed by tool "
                         "messages answering each tool_call_id; the following tool_call_ids did not have response "
                         f"messages: {', '.join(unanswered)}")
