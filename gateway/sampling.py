"""OpenAI request fields → engine SamplingParams."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from engine.config import SamplingParams
from engine.grammar import check as check_constraint
from engine.structured_outputs import StructuredOutputs
from gateway.errors import APIError, invalid_request
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.schema_check import check_json_schema, closed_schema

MAX_STOP = 4
UNSUPPORTED_VLLM_FIELDS = ("guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")


def to_sampling_params(body: ChatCompletionRequest | CompletionRequest,
                       tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
    """`tool_constraint`: what `tool_choice` required or named demands of the output (gateway/tool_calls/plan.py)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise invalid_request(f"stop: at most {MAX_STOP} sequences", "stop")
    fields: dict[str, Any] = {"n": body.n, "stop": stop, "seed": body.seed, "ignore_eos": body.ignore_eos,
                              "logit_bias": body.token_logit_bias()}
    if isinstance(body, ChatCompletionRequest):
        fields["max_tokens"] = body.max_completion_tokens or body.max_tokens
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
        elif body.top_logprobs is not None:
            raise invalid_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    else:
        fields["max_tokens"] = body.max_tokens
        fields["logprobs"] = body.logprobs
        if body.best_of is not None and body.best_of > body.n:
            # best_of candidates, scored by their tokens' logprobs; the best n are returned (gateway/service.py)
            if body.stream:
                raise invalid_request("best_of: cannot be streamed; leave out stream or best_of", "best_of")
            fields["n"] = body.best_of
            fields["logprobs"] = body.logprobs or 0
        elif body.best_of is not None and body.best_of < body.n:
            raise invalid_request(f"best_of: must be at least n ({body.n})", "best_of")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    try:
        fields["structured_outputs"] = structured_outputs(body)
        if tool_constraint is not None:
            if fields["structured_outputs"] is not None:
                other = fields["structured_outputs"].field.split(".")[0]
                raise invalid_request(f"tool_choice: a required or named tool call cannot be combined with {other}",
                                      "tool_choice")
            fields["structured_outputs"] = tool_constraint
        return SamplingParams(**fields)
    except ValueError as e:
        raise value_error(e) from e


def structured_outputs(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    """The one constraint the request's output must match, its shape checked (check_structured_outputs compiles
    it)."""
    for name in UNSUPPORTED_VLLM_FIELDS:
        if getattr(body, name) is not None:
            raise invalid_request(f"{name}: not supported by this server", name)
    given: list[StructuredOutputs] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(StructuredOutputs(json_object=True, field_name="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise invalid_request("response_format.json_schema: required when type is json_schema",
                                  "response_format.json_schema")
        if fmt.json_schema.schema_ is None:
            raise invalid_request("response_format.json_schema.schema: required", "response_format.json_schema.schema")
        schema = fmt.json_schema.schema_
        given.append(StructuredOutputs(json=closed_schema(schema) if fmt.json_schema.strict else schema,
                                       field_name="response_format.json_schema.schema"))
    if body.structured_outputs is not None:
        extra = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given.append(StructuredOutputs.of(extra))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            given.append(StructuredOutputs(**{kind: value, "field_name": name}))
    if len(given) > 1:
        raise invalid_request(f"{given[1].field.split('.')[0]}: only one of response_format, structured_outputs "
                              "and guided_* may constrain a request", given[1].field.split(".")[0])
    return given[0] if given else None


async def check_structured_outputs(params: SamplingParams) -> None:
    """llguidance checks the constraint (no tokenizer needed) in a worker thread, off the event loop, after a JSON
    schema has passed the meta-schema (whose 400 says where in the schema): a bad schema, regex or grammar is a 400
    naming the field the client sent, before anything is admitted or run."""
    spec = params.structured_outputs
    if spec is None:
        return
    try:
        if spec.kind == "json":
            await run_in_threadpool(check_json_schema, spec.json, spec.field)
        await run_in_threadpool(check_constraint, spec)
    except ValueError as e:
        raise value_error(e) from e


def value_error(e: ValueError) -> APIError:
    """An engine ValueError says 'field: problem'; the field becomes the error's param."""
    message = str(e)
    head, sep, _ = message.partition(":")
    param = head if sep and head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum() \
        else None
    return invalid_request(message, param)
