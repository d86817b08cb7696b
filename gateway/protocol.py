"""Request bodies of the OpenAI API, as strict pydantic models: a mistyped field is a 400, and so is a field this
server does not know (OpenAI's "Unrecognized request argument"), at the top level and inside nested objects."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gateway.errors import UNRECOGNIZED
from gateway.tool_calls.request import ToolCall, ToolFields, check_tool_history, check_tool_message, with_tool_fields
from gateway.unsupported_fields import CHAT_ONLY_AT, refusal

MAX_N = 16
MAX_TAGS = 32
MAX_TAG_CHARS = 200
# OpenAI's seed is a 64-bit integer; torch seeds overflow beyond it
SEED_RANGE = (-(2**63), 2**63 - 1)


class _Body(BaseModel):
    # NaN and infinities (which Python's JSON reader takes) are refused as what they are, not as out of range
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    text: str


_REPLAYED_ONLY_EMPTY = {
    "annotations": "url citations come from web search, which this server does not run; send [] or null",
    "audio": "audio answers are not supported: the models here answer in text; send null",
    "function_call": "the deprecated functions API is not supported; send the call as tool_calls",
}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=200)  # passed to the chat template, which may show it
    refusal: str | None = None  # an earlier assistant refusal, as the SDK replays a response's message
    tool_calls: list[ToolCall] | None = None  # assistant (gateway/tool_calls/)
    tool_call_id: str | None = None  # tool
    # the rest of a response message as the SDK's model_dump() replays it: taken where it says nothing
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    @field_validator("annotations", "audio", "function_call")
    @classmethod
    def _says_nothing(cls, v: Any, info: ValidationInfo) -> Any:
        if v:  # null (and annotations' []) is what a replayed text answer carries
            raise ValueError(_REPLAYED_ONLY_EMPTY[info.field_name])
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """Each part a text part; an error names the part's own key (not the branches of the union)."""
        if not isinstance(v, list):
            return v
        parts: list[Any] = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"{i}.type: content parts of type `{kind}` are not supported: the models here "
                                 "read text only")
            try:
                parts.append(TextPart.model_validate(part) if isinstance(part, dict) else part)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in (i, *first["loc"]))
                why = UNRECOGNIZED if first["type"] == "extra_forbidden" else first["msg"]
                raise ValueError(f"{where}: {why}") from None
        return parts

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        check_tool_message(self.role, self.tool_calls, self.tool_call_id)
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return with_tool_fields(message, self.tool_calls, self.tool_call_id)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("stream obfuscation is not supported by this server; send false or leave it out")
        return v


class _Closed(_Body):
    """A nested object whose unknown keys are refused (400 naming them), not dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")


class JSONSchemaFormat(_Closed):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way; strict also closes its objects (no undeclared keys)


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Closed):
    """vLLM's extra `structured_outputs` parameter (exactly one key)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Body):
    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token id (a JSON key, so a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=200)
    metadata: dict[str, Any] | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    # (gateway/sampling.py turns them into one engine constraint)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM options this gateway does not honour: declared so that sending one is a 400, not silently dropped
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Strings with unpaired UTF-16 surrogates (JSON "\\ud800") can be neither tokenized nor stored."""
        path = unpaired_surrogate_at(data)
        if path is not None:
            raise ValueError(f"{path or 'body'}: contains an unpaired UTF-16 surrogate; send valid Unicode text")
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdecimal() or not key.isascii():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return v

    def token_logit_bias(self) -> dict[int, float] | None:
        return {int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None

    def end_user(self) -> str | None:
        """Whom the request is for (usage events' end user)."""
        return self.user

    @field_validator("user")
    @classmethod
    def _storable_user(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @field_validator("metadata")
    @classmethod
    def _storable_tags(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """metadata.tags is stored on every usage event: a comma list or a list of scalars, bounded."""
        raw = (v or {}).get("tags")
        if raw is None:
            return v
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list) or any(isinstance(t, (list, dict)) for t in items):
            raise ValueError("tags: must be a string or a list of strings")
        if len(items) > MAX_TAGS:
            raise ValueError(f"tags: at most {MAX_TAGS} tags")
        for t in items:
            text = str(t)
            if len(text) > MAX_TAG_CHARS or "\x00" in text:
                raise ValueError(f"tags: each tag at most {MAX_TAG_CHARS} characters, without NUL characters")
        return v

    def tags(self) -> list[str]:
        raw = (self.metadata or {}).get("tags")
        if isinstance(raw, str):
            return [t.strip() for t in raw.split(",") if t.strip()]
        if isinstance(raw, list):
            return [str(t) for t in raw]
        return []


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # OpenAI's safety identifier: the end user when `user` is not given (usage events keep one end user)
    safety_identifier: str | None = Field(None, max_length=200)
    # a routing hint at OpenAI; here every request of a tenant shares cached prefixes anyway
    prompt_cache_key: str | None = Field(None, max_length=1024)
    # accepted only at the value that describes what this server does (gateway/unsupported_fields.py)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    @model_validator(mode="after")
    def _only_what_this_server_does(self) -> ChatCompletionRequest:
        refused = refusal(CHAT_ONLY_AT, self)
        if refused is not None:
            raise ValueError(refused)
        check_tool_history(self.messages)
        if self.user is not None and self.safety_identifier not in (None, self.user):
            raise ValueError("safety_identifier: differs from user; usage events keep one end user per request, so "
                             "send one of them or the same value in both")
        return self

    @field_validator("safety_identifier", "prompt_cache_key")
    @classmethod
    def _storable_ids(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    def end_user(self) -> str | None:
        return self.user if self.user is not None else self.safety_identifier


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """One of the four shapes, named in the error (not the union's branches)."""
        def token_ids(items: Any) -> bool:
            return isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)

        if isinstance(v, str) or token_ids(v) or (isinstance(v, list) and (all(isinstance(t, str) for t in v)
                                                                          or all(token_ids(t) for t in v))):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported by this server: the answer never repeats the prompt; send false")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported by this server: text is only appended after the prompt, never inserted "
                             "before a suffix")
        return v


# OpenAI's bound on the inputs of one embeddings request
MAX_EMBEDDING_INPUTS = 2048
_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Every field is honoured; any other is refused (400 naming it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=200)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        """One of the four shapes, none of it empty, at most MAX_EMBEDDING_INPUTS inputs, valid Unicode."""
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            raise ValueError(f"input: must be {_INPUT_SHAPES}")
        if not items:
            raise ValueError("input: must not be empty")
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            items = [v]  # one input given as token ids
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs in one request, got {len(items)}")
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input: input {i} is an empty string")
                if unpaired_surrogate_at(item) is not None:
                    raise ValueError(f"input: input {i} contains an unpaired UTF-16 surrogate; send valid Unicode")
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                if not item:
                    raise ValueError(f"input: input {i} is an empty list of token ids")
                if any(t < 0 for t in item):
                    raise ValueError(f"input: input {i} holds a negative token id")
            else:
                raise ValueError(f"input: must be {_INPUT_SHAPES}, not a mix")
        if len({isinstance(item, str) for item in items}) > 1:
            raise ValueError(f"input: must be {_INPUT_SHAPES}, not a mix")
        return v

    @field_validator("model", "user")
    @classmethod
    def _storable(cls, v: str | None) -> str | None:
        if v is not None and ("\x00" in v or unpaired_surrogate_at(v) is not None):
            raise ValueError("must be valid Unicode without NUL characters")
        return v

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: strings, or token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return self.input  # type: ignore[return-value]


def unpaired_surrogate_at(data: Any) -> str | None:
    """The dotted path of the first string (value or key) in `data` holding an unpaired surrogate, or
    None. Walks iteratively: deep nesting costs no recursion."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                child = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not _encodable(k):
                    return path
                stack.append((child, v))
        elif isinstance(value, list):  # token ids need no look: only strings and containers are pushed
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)
                         if isinstance(v, str | dict | list))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class CacheFeedbackRequest(BaseModel):
    """POST /v1/cache/feedback: a cached answer the client found wrong, by the response id it came with."""

    model_config = ConfigDict(strict=True, extra="forbid")

    response_id: str = Field(min_length=1, max_length=200)
