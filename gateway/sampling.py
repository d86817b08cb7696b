"""OpenAI request fields → engine SamplingParams."""

from __future__ import annotations

from typing import Any

from engine.config import SamplingParams
from gateway.errors import APIError, invalid_request
from gateway.protocol import ChatCompletionRequest, CompletionRequest

MAX_STOP = 4


def to_sampling_params(body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise invalid_request(f"stop: at most {MAX_STOP} sequences", "stop")
    fields: dict[str, Any] = {"n": body.n, "stop": stop, "seed": body.seed, "ignore_eos": body.ignore_eos}
    if isinstance(body, ChatCompletionRequest):
        fields["max_tokens"] = body.max_completion_tokens or body.max_tokens
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
        elif body.top_logprobs is not None:
            raise invalid_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    else:
        fields["max_tokens"] = body.max_tokens
        fields["logprobs"] = body.logprobs
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise value_error(e) from e


def value_error(e: ValueError) -> APIError:
    """An engine ValueError says 'field: problem'; the field becomes the error's param."""
    message = str(e)
    head, sep, _ = message.partition(":")
    param = head if sep and head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum() \
        else None
    return invalid_request(message, param)
