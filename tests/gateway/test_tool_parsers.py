"""The tool-call parsers on hand-written model outputs: each format's calls, text around them, malformed calls that stay
text, and the same events whether the output comes whole or in pieces of any size."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from gateway.tool_calls.output import delta_of, message_of, parse_whole
from gateway.tool_calls.parsers import (CallArguments, CallStart, Content, Event, ForcedCallsParser, HermesParser,
                                        Llama3JsonParser, NamedCallParser, ToolCallParser)

NAMES = frozenset({"get_weather", "get_time"})


def message(parser: ToolCallParser, text: str) -> dict:
    return message_of(parse_whole(parser, text), parser.calls_only)


def calls(msg: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


def streamed(parser: ToolCallParser, text: str, rng: random.Random) -> list[Event]:
    events: list[Event] = []
    at = 0
    while at < len(text):
        step = rng.randint(1, 7)
        events += parser.feed(text[at:at + step])
        at += step
    return events + parser.finish()


def without_ids(events: list[Event]) -> dict:
    """What the events say, however they were cut: content, and each call's name and whole arguments."""
    msg = message_of(events)
    return {"content": msg["content"], "calls": [(c["function"]["name"], c["function"]["arguments"])
                                                  for c in msg.get("tool_calls", [])]}


def test_hermes_reads_a_call_after_text():
    msg = message(HermesParser(NAMES), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}\n</tool_call>')
    assert msg["content"] == "Let me check."
    assert calls(msg) == [("get_weather", {"city": "Paris"})]
    assert msg["tool_calls"][0]["id"].startswith("call_") and msg["tool_calls"][0]["type"] == "function"


def test_hermes_content_is_null_when_the_output_is_only_calls():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>\n')
    msg = message(HermesParser(NAMES), text)
    assert msg["content"] is None
    assert calls(msg) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2


def test_hermes_without_parallel_calls_keeps_the_first():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert calls(message(HermesParser(NAMES, parallel=False), text)) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>',  # bad JSON
    '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',  # not one of the tools
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_weather", "arguments": {}, "extra": 1}</tool_call>',  # not a call's keys
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off, unclosed
])
def test_hermes_malformed_call_stays_text(block):
    msg = message(HermesParser(NAMES), "Sure: " + block)
    assert "tool_calls" not in msg
    assert msg["content"] == ("Sure: " + block).strip()


def test_hermes_unclosed_block_holding_a_whole_call_is_a_call():
    msg = message(HermesParser(NAMES), '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n')
    assert calls(msg) == [("get_time", {"tz": "UTC"})]


def test_hermes_plain_text_and_a_tag_prefix_at_the_end_are_content():
    assert message(HermesParser(NAMES), "Hello there") == {"role": "assistant", "content": "Hello there",
                                                           "refusal": None}
    assert message(HermesParser(NAMES), "a < b and <tool")["content"] == "a < b and <tool"


def test_llama3_json_reads_calls_with_python_tag_and_semicolons():
    one = message(Llama3JsonParser(NAMES), '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one["content"] is None and calls(one) == [("get_weather", {"city": "Oslo"})]
    two = message(Llama3JsonParser(NAMES), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                           '{"name": "get_time", "parameters": {"tz": "CET"}}')
    assert calls(two) == [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]
    assert len(calls(message(Llama3JsonParser(NAMES, parallel=False), '{"name": "get_time", "parameters": {}};'
                                                                      '{"name": "get_time", "parameters": {}}'))) == 1


@pytest.mark.parametrize("text", [
    "The weather in Oslo is mild.",
    '{"name": "get_weather", "parameters": {"city": "Os',  # cut off
    '{"answer": 42}',  # JSON, not a call
    '{"name": "get_weather", "parameters": {}} and then some text',
    '{"name": "unknown_tool", "parameters": {}}',
])
def test_llama3_json_output_that_is_not_a_call_is_text(text):
    msg = message(Llama3JsonParser(NAMES), text)
    assert "tool_calls" not in msg and msg["content"] == text


def test_forced_calls_stream_arguments_in_pieces_with_braces_and_escapes_inside_strings():
    args = {"city": "Pa}r{is \"x\" \\", "nested": {"list": [1, {"a": "]"}]}}
    text = json.dumps([{"name": "get_weather", "arguments": args}, {"name": "get_time", "arguments": {"tz": "é"}}],
                      ensure_ascii=False)
    parser = ForcedCallsParser("arguments")
    events = [e for i in range(len(text)) for e in parser.feed(text[i])] + parser.finish()
    assert [e.name for e in events if isinstance(e, CallStart)] == ["get_weather", "get_time"]
    assert sum(isinstance(e, CallArguments) and e.index == 0 for e in events) > 10  # a piece a character
    assert calls(message_of(events)) == [("get_weather", args), ("get_time", {"tz": "é"})]


def test_forced_call_as_one_object_and_with_the_arguments_key_first():
    single = message(ForcedCallsParser("parameters"), '{"name": "get_time", "parameters": {"tz": "CET"}}')
    assert single["content"] is None and calls(single) == [("get_time", {"tz": "CET"})]
    reordered = message(ForcedCallsParser("arguments"), '{"arguments": {"tz": "CET"}, "name": "get_time"}')
    assert calls(reordered) == [("get_time", {"tz": "CET"})]


def test_named_call_is_the_whole_output_as_arguments():
    msg = message(NamedCallParser("get_weather"), '{"city": "Rome"}')
    assert msg["content"] is None and calls(msg) == [("get_weather", {"city": "Rome"})]


CASES: list[tuple[Callable[[], ToolCallParser], str]] = [
    (lambda: HermesParser(NAMES), 'I will call it.  <tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                  '"Paris"}}\n</tool_call>\n<tool_call>{"name": "nope"}</tool_call> trailing <tool'),
    (lambda: HermesParser(NAMES), "  plain answer\nwith two lines  "),
    (lambda: Llama3JsonParser(NAMES), '  {"name": "get_time", "parameters": {"tz": "UTC"}}'),
    (lambda: Llama3JsonParser(NAMES), "<|python_tag|> not json"),
    (lambda: ForcedCallsParser("arguments"), '[{"name": "get_time", "arguments": {"tz": "U{T}C"}}, '
                                             '{"name": "get_weather", "arguments": {"city": "\\"Rome\\""}}]'),
    (lambda: NamedCallParser("get_time"), '{"tz": "UTC"}'),
]


@pytest.mark.parametrize(("make", "text"), CASES)
def test_streamed_pieces_say_what_the_whole_output_says(make, text):
    whole = without_ids(parse_whole(make(), text))
    for seed in range(20):
        events = streamed(make(), text, random.Random(seed))
        assert without_ids(events) == whole
        assert all(delta_of([e]) for e in events)  # no empty pieces


def test_delta_shape_is_openais():
    start, piece = CallStart(0, "call_x", "get_time"), CallArguments(0, '{"tz"')
    assert delta_of([Content("hi"), start, piece]) == {"content": "hi", "tool_calls": [
        {"index": 0, "id": "call_x", "type": "function", "function": {"name": "get_time", "arguments": '{"tz"'}}]}
    assert delta_of([CallArguments(1, ": 1}")]) == {"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}]}
