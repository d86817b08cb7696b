"""The OpenAI JSON shapes of chat and text completions, streamed and whole."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.backends import ChoiceDelta, TokenInfo
from gateway.tool_calls.output import delta_of, message_of, parse_whole
from gateway.tool_calls.output import finish_reason as tool_finish_reason
from gateway.tool_calls.parsers import ToolCallParser

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


_FINISH_JSON = {None: b"null", "length": b'"length"', "stop": b'"stop"'}


class _DeltaBytes:
    """A streamed request's delta events as bytes, built around its text from a prefix made once per request: the
    same bytes `sse(fmt.delta(...))` makes, at a fraction of the cost (an event per token, thousands a second)."""

    def __init__(self, obj: str, rid: str, created: int, model: str, text_key: bytes) -> None:
        self.key = (rid, created, model)
        self.prefix = (b'data: {"id":' + json.dumps(rid).encode() + b',"object":"' + obj.encode() + b'","created":'
                       + str(created).encode() + b',"model":' + json.dumps(model).encode() + b',"choices":[{"index":')
        self.text_key = text_key

    def event(self, c: ChoiceDelta, text_json: bytes | None) -> bytes:
        return b"".join((self.prefix, str(c.index).encode(), self.text_key,
                         text_json if text_json is not None else b"", self.suffix(c)))

    @staticmethod
    def suffix(c: ChoiceDelta) -> bytes:
        return b',"logprobs":null,"finish_reason":' + _FINISH_JSON[_finish(c.finish_reason)] + b"}]}\n\n"


@dataclass
class ChoiceText:
    """One choice of a whole (non-streamed) response, accumulated from the chunks."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


class ChatFormat:
    object = "chat.completion"
    endpoint = "chat.completions"
    id_prefix = "chatcmpl-"

    def __init__(self, want_logprobs: bool, new_tool_parser: Callable[[], ToolCallParser | None] | None = None) -> None:
        self.want_logprobs = want_logprobs
        self._bytes: _DeltaBytes | None = None
        # a request with tools reads each choice's output through a parser of tool calls (gateway/tool_calls/)
        self._new_tool_parser = new_tool_parser
        self._tool_parsers: dict[int, ToolCallParser] = {}

    def _tool_parser(self, index: int) -> ToolCallParser | None:
        if self._new_tool_parser is None:
            return None
        if index not in self._tool_parsers:
            parser = self._new_tool_parser()
            if parser is None:
                self._new_tool_parser = None
                return None
            self._tool_parsers[index] = parser
        return self._tool_parsers[index]

    def opening(self, rid: str, created: int, model: str, n: int) -> list[dict[str, Any]]:
        return [self._chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None, None)
                for i in range(n)]

    def delta(self, rid: str, created: int, model: str, c: ChoiceDelta) -> dict[str, Any]:
        lp = self._logprobs(c.logprobs) if self.want_logprobs and c.logprobs is not None else None
        body = {"content": c.text} if c.text or c.finish_reason is None else {}
        return self._chunk(rid, created, model, c.index, body, _finish(c.finish_reason), lp)

    def _tool_delta_event(self, rid: str, created: int, model: str, c: ChoiceDelta, parser: ToolCallParser) -> bytes:
        events = parser.feed(c.text)
        if c.finish_reason is not None:
            events += parser.finish()
        body = delta_of(events)
        finish = _finish(c.finish_reason)
        lp = self._logprobs(c.logprobs) if self.want_logprobs and c.logprobs is not None else None
        if not body and finish is None and lp is None:
            return b""  # the parser holds the text back (a call being written)
        return sse(self._chunk(rid, created, model, c.index, body, tool_finish_reason(finish, parser), lp))

    def delta_event(self, rid: str, created: int, model: str, c: ChoiceDelta) -> bytes:
        """`sse(self.delta(...))`, faster."""
        parser = self._tool_parser(c.index)
        if parser is not None:
            return self._tool_delta_event(rid, created, model, c, parser)
        if self.want_logprobs and c.logprobs is not None:
            return sse(self.delta(rid, created, model, c))
        if self._bytes is None or self._bytes.key != (rid, created, model):
            self._bytes = _DeltaBytes("chat.completion.chunk", rid, created, model, b',"delta":')
        if c.text or c.finish_reason is None:
            return self._bytes.event(c, b'{"content":' + json.dumps(c.text).encode() + b"}")
        return self._bytes.event(c, b"{}")

    def usage_chunk(self, rid: str, created: int, model: str, u: dict[str, Any]) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                "usage": u}

    def response(self, rid: str, created: int, model: str, choices: list[ChoiceText],
                 u: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, **self._message(c), "logprobs": self._logprobs(c.logprobs) if self.want_logprobs
                         else None} for i, c in enumerate(choices)],
            "usage": u,
        }

    def _message(self, c: ChoiceText) -> dict[str, Any]:
        text, finish = "".join(c.text), _finish(c.finish_reason)
        parser = self._new_tool_parser() if self._new_tool_parser is not None else None
        if parser is None:
            return {"message": {"role": "assistant", "content": text, "refusal": None}, "finish_reason": finish}
        return {"message": message_of(parse_whole(parser, text), parser.calls_only), "finish_reason": tool_finish_reason(finish, parser)}

    @staticmethod
    def _chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any], finish: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    @staticmethod
    def _logprobs(infos: list[TokenInfo]) -> dict[str, Any]:
        def entry(t: TokenInfo) -> dict[str, Any]:
            return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}

        return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in infos], "refusal": None}


class CompletionFormat:
    object = "text_completion"
    endpoint = "completions"
    id_prefix = "cmpl-"

    def __init__(self, want_logprobs: bool) -> None:
        self.want_logprobs = want_logprobs
        self._bytes: _DeltaBytes | None = None
        self._streamed_offsets: dict[int, _TextOffsets] = {}  # a streamed choice's, from one delta to the next

    def opening(self, rid: str, created: int, model: str, n: int) -> list[dict[str, Any]]:
        return []

    def delta(self, rid: str, created: int, model: str, c: ChoiceDelta) -> dict[str, Any]:
        lp = None
        if self.want_logprobs and c.logprobs is not None:
            lp = self._logprobs(c.logprobs, self._streamed_offsets.setdefault(c.index, _TextOffsets()))
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": c.index, "text": c.text, "logprobs": lp,
                             "finish_reason": _finish(c.finish_reason)}]}

    def delta_event(self, rid: str, created: int, model: str, c: ChoiceDelta) -> bytes:
        """`sse(self.delta(...))`, faster."""
        if self.want_logprobs and c.logprobs is not None:
            return sse(self.delta(rid, created, model, c))
        if self._bytes is None or self._bytes.key != (rid, created, model):
            self._bytes = _DeltaBytes("text_completion", rid, created, model, b',"text":')
        return self._bytes.event(c, json.dumps(c.text).encode())

    def usage_chunk(self, rid: str, created: int, model: str, u: dict[str, Any]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                "usage": u}

    def response(self, rid: str, created: int, model: str, choices: list[ChoiceText],
                 u: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": "".join(c.text),
                         "logprobs": self._logprobs(c.logprobs, _TextOffsets()) if self.want_logprobs else None,
                         "finish_reason": _finish(c.finish_reason)} for i, c in enumerate(choices)],
            "usage": u,
        }

    @staticmethod
    def _logprobs(infos: list[TokenInfo], offsets: _TextOffsets) -> dict[str, Any]:
        return {"tokens": [t.token for t in infos], "token_logprobs": [t.logprob for t in infos],
                "top_logprobs": [{a.token: a.logprob for a in t.top} for t in infos],
                "text_offset": offsets.of(infos)}


class _TextOffsets:
    """Where each token's text begins in its choice's text: the characters its tokens' bytes made before it (one
    that begins inside a character is at that character)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def of(self, infos: list[TokenInfo]) -> list[int]:
        offsets = []
        for t in infos:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(t.bytes))
        return offsets
