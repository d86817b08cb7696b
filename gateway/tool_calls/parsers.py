"""Tool calls read from a model's output text, as it streams. Each parser takes the text in pieces (`feed`) and at
the end (`finish`) and returns events: content text, a call's start (its id and name), pieces of a call's arguments.
The same events make the streamed deltas and the whole message, so both say the same thing.

- `hermes`: Hermes / Qwen 2.5 and the fallback prompt format (engine/tool_prompt.py):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around them is content.
- `llama3_json`: Llama 3.1 / 3.2 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (several are
  separated by `;`), optionally after `<|python_tag|>`.
- ForcedCallsParser and NamedCallParser read the output that constrained decoding wrote for `tool_choice: required`
  and a named function (gateway/tool_calls/plan.py), streaming arguments as they come.

`auto` output that is not a well-formed call of a known function (bad JSON, an unknown name, arguments that are not
an object) stays text."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


class ToolCallParser(Protocol):
    num_calls: int  # calls started so far
    calls_only: bool  # constrained to calls (`required`, a named function): the output is never content

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(text: str, names: frozenset[str]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call written as a JSON object, or None when it is not a call of a known function."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return call_of(obj, names)


def call_of(obj: Any, names: frozenset[str]) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    given = [k for k in ARGUMENT_KEYS if k in obj]
    if len(given) > 1 or set(obj) - {"name", *given}:
        return None
    arguments = obj[given[0]] if given else {}
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


class ContentWriter:
    """Content events without the whitespace at either end of the answer or next to a call: the streamed and the
    whole message then hold the same content."""

    def __init__(self) -> None:
        self.held = ""  # trailing whitespace, written only if more text follows
        self.started = False

    def write(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if not self.started:
            body = body.lstrip()
        if body:
            out.append(Content(body))
            self.started = True

    def drop_held(self) -> None:
        self.held = ""


class _Calls:
    """The calls a parser has emitted; with parallel calls off, only the first."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.num_calls = 0

    def emit(self, name: str, arguments: dict[str, Any], out: list[Event]) -> None:
        if self.num_calls and not self.parallel:
            return
        out.append(CallStart(self.num_calls, new_call_id(), name))
        out.append(CallArguments(self.num_calls, json.dumps(arguments, ensure_ascii=False)))
        self.num_calls += 1


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    calls_only = False

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names = names
        self.calls = _Calls(parallel)
        self.content = ContentWriter()
        self.unread = ""
        self.inside = False  # after an opening tag

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.unread += text
        while True:
            if not self.inside:
                at = self.unread.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self.unread, self.OPEN)
                    self.content.write(self.unread[:len(self.unread) - keep], out)
                    self.unread = self.unread[len(self.unread) - keep:]
                    return out
                self.content.write(self.unread[:at], out)
                self.unread, self.inside = self.unread[at + len(self.OPEN):], True
            else:
                at = self.unread.find(self.CLOSE)
                if at < 0:
                    return out
                self._block(self.unread[:at], True, out)
                self.unread, self.inside = self.unread[at + len(self.CLOSE):], False

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.inside:  # a block the model did not close: a call still, if it is one whole
            self._block(self.unread, False, out)
        else:
            self.content.write(self.unread, out)
        self.unread, self.inside = "", False
        self.content.drop_held()
        return out

    def _block(self, raw: str, closed: bool, out: list[Event]) -> None:
        call = parse_call(raw.strip(), self.names)
        if call is None:
            self.content.write(self.OPEN + raw + (self.CLOSE if closed else ""), out)
        else:
            self.content.drop_held()
            self.calls.emit(*call, out)


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"
    calls_only = False

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names = names
        self.calls = _Calls(parallel)
        self.content = ContentWriter()
        self.unread = ""
        self.mode: str | None = None  # "call": the output began like a call and is read at the end; "text"

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.mode == "text":
            self.content.write(text, out)
            return out
        self.unread += text
        if self.mode is None:
            head = self.unread.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return out
            if head.startswith("{") or head.startswith(self.PYTHON_TAG):
                self.mode = "call"
            else:
                self.mode = "text"
                self.content.write(self.unread, out)
                self.unread = ""
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        calls = self._calls(self.unread) if self.mode == "call" else None
        if calls is None:
            self.content.write(self.unread, out)
        else:
            for call in calls:
                self.calls.emit(*call, out)
        self.unread = ""
        self.content.drop_held()
        return out

    def _calls(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        text = text.strip().removeprefix(self.PYTHON_TAG)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or (text[at] == ";" and calls)):
                at += 1
            if at == len(text):
                return calls or None
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = call_of(obj, self.names)
            if call is None:
                return None
            calls.append(call)


class NamedCallParser:
    """The output is the named function's arguments object (constrained decoding wrote it)."""

    calls_only = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.num_calls == 0:
            out.append(CallStart(0, new_call_id(), self.name))
            self.num_calls = 1
        if text:
            out.append(CallArguments(0, text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("")


class ForcedCallsParser:
    """The output is one call object or an array of them, `{"name": "...", "<arguments_key>": {...}}` with the name
    first (constrained decoding wrote it so); each call starts once its name is read, and its arguments stream as
    they are written. A character scanner: it tracks strings and nesting, so braces inside strings are text."""

    calls_only = True

    def __init__(self, arguments_key: str) -> None:
        self.key = arguments_key
        self.num_calls = 0  # calls started (their name was read)
        self.depth = 0
        self.call_depth: int | None = None  # nesting of a call object's members: 1 alone, 2 inside an array
        self.in_string = self.escape = False
        self.string: list[str] | None = None  # a key or value string read at the call object's level
        self.expect_key = False
        self.member: str | None = None  # the key whose value comes next
        self.capturing = False  # inside the arguments value
        self.index = -1  # the call object being read
        self.name: str | None = None
        self.pending = ""  # arguments read before the name

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        piece: list[str] = []
        for ch in text:
            if self.capturing:
                piece.append(ch)
            if self.in_string:
                self._string_char(ch, out)
            elif ch == '"':
                self.in_string = True
                if not self.capturing and self.depth == self.call_depth:
                    self.string = []
            elif ch in "{[":
                self._open(ch, piece)
            elif ch in "}]":
                self.depth -= 1
                if self.capturing and self.depth == self.call_depth:
                    self.capturing = False
                    self._arguments("".join(piece), out)
                    piece.clear()
            elif self.depth == self.call_depth and not self.capturing:
                if ch == ":":
                    self.expect_key = False
                elif ch == ",":
                    self.expect_key, self.member = True, None
        if piece:
            self._arguments("".join(piece), out)
        return out

    def finish(self) -> list[Event]:
        return []

    def _open(self, ch: str, piece: list[str]) -> None:
        if self.call_depth is None:
            self.call_depth = 1 if ch == "{" else 2
        if (self.depth == self.call_depth and not self.capturing and not self.expect_key
                and self.member == self.key):
            self.capturing = True
            piece.append(ch)
        self.depth += 1
        if self.depth == self.call_depth and ch == "{":
            self.index, self.name, self.pending = self.index + 1, None, ""
            self.expect_key, self.member = True, None

    def _string_char(self, ch: str, out: list[Event]) -> None:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            if self.string is not None:
                self._string_done(json.loads('"' + "".join(self.string) + '"'), out)
                self.string = None
            return
        if self.string is not None:
            self.string.append(ch)

    def _string_done(self, value: str, out: list[Event]) -> None:
        if self.expect_key:
            self.member = value
        elif self.member == "name" and self.name is None:
            self.name = value
            out.append(CallStart(self.index, new_call_id(), value))
            self.num_calls += 1
            if self.pending:
                out.append(CallArguments(self.index, self.pending))
                self.pending = ""

    def _arguments(self, text: str, out: list[Event]) -> None:
        if self.name is None:
            self.pending += text
        else:
            out.append(CallArguments(self.index, text))
