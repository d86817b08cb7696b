"""Parser events in OpenAI's shapes: a streamed chunk's `delta` ({content, tool_calls: [{index, id, type, function:
{name, arguments}}]}, arguments in pieces) and a whole response's `message` (content null when it holds only calls)."""

from __future__ import annotations

from typing import Any

from gateway.tool_calls.parsers import CallArguments, CallStart, Content, Event, ToolCallParser


def delta_of(events: list[Event]) -> dict[str, Any]:
    """One chunk's delta: the events' content joined, and one tool_calls entry per call they touch."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, CallArguments):
            entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


def message_of(events: list[Event], calls_only: bool = False) -> dict[str, Any]:
    """A whole response's assistant message. Its content is null when it holds calls, and when the output was
    constrained to calls (`calls_only`) even if max_tokens cut it before a call's name was read (as OpenAI's forced
    calls: their output is never content)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, CallArguments) and e.index in calls:
            calls[e.index]["function"]["arguments"] += e.text
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls or calls_only else ""), "refusal": None}
    if calls:
        message["tool_calls"] = list(calls.values())
    return message


def parse_whole(parser: ToolCallParser, text: str) -> list[Event]:
    return parser.feed(text) + parser.finish()


def finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    """`tool_calls` when the choice stopped after calling; `length` stays (the last call's arguments are cut)."""
    return "tool_calls" if reason == "stop" and parser.num_calls else reason
