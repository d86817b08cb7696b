"""OpenAI request fields this server accepts only at the value that describes what it already does; any other value
is a 400 naming the field (never a silently different answer). Fields not declared at all are refused by the request
models themselves (gateway/protocol.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OnlyAt:
    accepts: Callable[[Any], bool]
    why: str


def _absent(v: Any) -> bool:
    return v is None


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


def _implicit_prompt_cache(v: Any) -> bool:
    return v is None or v == {} or v == {"mode": "implicit"}


CHAT_ONLY_AT: Mapping[str, OnlyAt] = {
    "audio": OnlyAt(_absent, "audio output is not supported: the models here answer in text"),
    "modalities": OnlyAt(_one_of(["text"]), 'only ["text"] is supported: the models here answer in text'),
    "prediction": OnlyAt(_absent, "predicted outputs are not supported by this server"),
    "web_search_options": OnlyAt(_absent, "web search is not available on this server"),
    "moderation": OnlyAt(_absent, "moderation is not run by this server"),
    "store": OnlyAt(_one_of(False), "this server does not store completions; send false or leave it out"),
    "service_tier": OnlyAt(_one_of("auto", "default"),
                           'this server has one service tier; send "auto" or "default" or leave it out'),
    "reasoning_effort": OnlyAt(_one_of("none"),
                               'the models here do not reason before they answer; send "none" or leave it out'),
    "verbosity": OnlyAt(_absent, "not supported by the models here; leave it out and ask for length in the prompt"),
    # prefix caching here is automatic for every request (its blocks live in memory, evicted least recently used)
    "prompt_cache_options": OnlyAt(_implicit_prompt_cache, 'prefix caching here is automatic; only {"mode": '
                                   '"implicit"} is supported, without a ttl'),
    "prompt_cache_retention": OnlyAt(_one_of("in_memory"),
                                     'cached prefixes live in memory here; send "in_memory" or leave it out'),
}


def refusal(fields: Mapping[str, OnlyAt], body: object) -> str | None:
    """'field: why' for the first field of `body` set to a value it is not accepted at, else None."""
    for name, rule in fields.items():
        if not rule.accepts(getattr(body, name)):
            return f"{name}: {rule.why}"
    return None
