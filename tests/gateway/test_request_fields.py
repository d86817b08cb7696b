"""Every field the official openai SDK can send to /v1/chat/completions and /v1/completions (read from its own request
types, so a field added to the SDK fails here until it is classified) is honoured — a named test shows its effect —
or refused with a 400 in OpenAI's shape whose `param` names it. Refusals come before the model runs; the effect tests
run the tiny model once each."""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

import openai
import pytest
from openai.types import completion_create_params as completion_sdk
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_sdk
from openai.types.chat.chat_completion_assistant_message_param import ContentArrayOfContentPart
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import UsageEvent
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.sampling import to_sampling_params
from tests.gateway.conftest import MODEL

ASK = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_BASE: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 1}
COMPLETION_BASE: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
HERE = "tests/gateway/test_request_fields.py"
CLIENT_TESTS = "tests/gateway/test_openai_client.py"

TOOLS = "tests/gateway/test_tool_calling.py"
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# the deprecated functions API's message role: refused (a case of the nested refusals below)
REFUSED_ROLES = frozenset({"function"})


@dataclass(frozen=True)
class Honoured:
    effect: str  # "path::test" that shows what the field does
    fields: dict[str, Any] = field(default_factory=dict)  # a body addition using it (checked without the model)


@dataclass(frozen=True)
class OnlyAt:
    """Accepted at the value that describes what this server does (no effect to show); other values are refused."""

    accepted: Any
    refused: Any


@dataclass(frozen=True)
class Refused:
    value: Any


SAMPLED = {"temperature": 1.3, "seed": 5}
CHAT_FIELDS: dict[str, Honoured | OnlyAt | Refused] = {
    "messages": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost"),
    "model": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost"),
    "max_tokens": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost", {"max_tokens": 3}),
    "user": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost", {"user": "alice"}),
    "metadata": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost", {"metadata": {"tags": "a,b"}}),
    "n": Honoured(f"{CLIENT_TESTS}::test_n_greater_than_one", {"n": 2}),
    "stream": Honoured(f"{CLIENT_TESTS}::test_chat_streamed_matches_plain_and_reports_usage", {"stream": True}),
    "stream_options": Honoured(f"{HERE}::test_continuous_usage_stats_count_every_chunk",
                               {"stream": True, "stream_options": {"include_usage": True}}),
    "logprobs": Honoured(f"{CLIENT_TESTS}::test_chat_logprobs", {"logprobs": True}),
    "top_logprobs": Honoured(f"{CLIENT_TESTS}::test_chat_logprobs", {"logprobs": True, "top_logprobs": 2}),
    "response_format": Honoured("tests/gateway/test_structured_outputs.py::"
                                "test_json_schema_response_format_is_followed_and_billed",
                                {"response_format": {"type": "json_object"}}),
    "max_completion_tokens": Honoured(f"{HERE}::test_max_completion_tokens_caps_the_answer",
                                      {"max_completion_tokens": 2}),
    "logit_bias": Honoured(f"{HERE}::test_logit_bias_forces_and_bans_tokens", {"logit_bias": {"42": -100}}),
    "frequency_penalty": Honoured(f"{HERE}::test_penalties_change_the_answer", {"frequency_penalty": 1.5}),
    "presence_penalty": Honoured(f"{HERE}::test_penalties_change_the_answer", {"presence_penalty": 1.5}),
    "seed": Honoured(f"{HERE}::test_seed_repeats_a_sampled_answer", SAMPLED),
    "temperature": Honoured(f"{HERE}::test_seed_repeats_a_sampled_answer", SAMPLED),
    "top_p": Honoured(f"{HERE}::test_top_p_near_zero_gives_the_greedy_answer", {"top_p": 0.5}),
    "stop": Honoured(f"{HERE}::test_stop_ends_the_answer_before_the_stop_text", {"stop": ["\n", "."]}),
    "safety_identifier": Honoured(f"{HERE}::test_values_that_match_this_server_are_accepted_together",
                                  {"safety_identifier": "hashed-user-1"}),
    # a routing hint at OpenAI that never changes an answer; here every request of a tenant shares cached prefixes
    "prompt_cache_key": Honoured(f"{HERE}::test_values_that_match_this_server_are_accepted_together",
                                 {"prompt_cache_key": "checkout-flow"}),
    "store": OnlyAt(False, True),
    "service_tier": OnlyAt("auto", "flex"),
    "modalities": OnlyAt(["text"], ["text", "audio"]),
    "reasoning_effort": OnlyAt("none", "high"),
    "prompt_cache_options": OnlyAt({"mode": "implicit"}, {"mode": "explicit"}),
    "prompt_cache_retention": OnlyAt("in_memory", "24h"),
    "tools": Honoured(f"{TOOLS}::test_forced_call_round_trip_ends_in_a_text_answer", {"tools": [TOOL]}),
    "tool_choice": Honoured(f"{TOOLS}::test_forced_call_round_trip_ends_in_a_text_answer",
                            {"tools": [TOOL], "tool_choice": "required"}),
    "parallel_tool_calls": Honoured(f"{TOOLS}::test_required_calls_validate_against_their_schemas_greedy_and_sampled",
                                    {"tools": [TOOL], "parallel_tool_calls": False}),
    "functions": Refused([TOOL["function"]]),
    "function_call": Refused("auto"),
    "audio": Refused({"voice": "alloy", "format": "mp3"}),
    "prediction": Refused({"type": "content", "content": "Paris"}),
    "web_search_options": Refused({}),
    "moderation": Refused({"model": "omni-moderation-latest"}),
    "verbosity": Refused("low"),
}

COMPLETION_FIELDS: dict[str, Honoured | OnlyAt | Refused] = {
    "model": Honoured(f"{CLIENT_TESTS}::test_completions_with_logprobs_and_stop"),
    "prompt": Honoured(f"{CLIENT_TESTS}::test_completions_with_logprobs_and_stop"),
    "max_tokens": Honoured(f"{CLIENT_TESTS}::test_completions_with_logprobs_and_stop", {"max_tokens": 3}),
    "logprobs": Honoured(f"{CLIENT_TESTS}::test_completions_with_logprobs_and_stop", {"logprobs": 2}),
    "stop": Honoured(f"{CLIENT_TESTS}::test_completions_with_logprobs_and_stop", {"stop": "."}),
    "best_of": Honoured(f"{HERE}::test_best_of_returns_the_likeliest_candidates", {"best_of": 3}),
    "logit_bias": Honoured(f"{HERE}::test_logit_bias_forces_and_bans_tokens", {"logit_bias": {"42": 100}}),
    # the same sampling path as chat's (gateway/sampling.py): chat's tests show the effects
    "n": Honoured(f"{CLIENT_TESTS}::test_n_greater_than_one", {"n": 2}),
    "frequency_penalty": Honoured(f"{HERE}::test_penalties_change_the_answer", {"frequency_penalty": 1.0}),
    "presence_penalty": Honoured(f"{HERE}::test_penalties_change_the_answer", {"presence_penalty": 1.0}),
    "seed": Honoured(f"{HERE}::test_seed_repeats_a_sampled_answer", SAMPLED),
    "temperature": Honoured(f"{HERE}::test_seed_repeats_a_sampled_answer", SAMPLED),
    "top_p": Honoured(f"{HERE}::test_top_p_near_zero_gives_the_greedy_answer", {"top_p": 0.5}),
    "user": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost", {"user": "alice"}),
    "stream": Honoured(f"{HERE}::test_continuous_usage_stats_count_every_chunk", {"stream": True}),
    "stream_options": Honoured(f"{HERE}::test_continuous_usage_stats_count_every_chunk",
                               {"stream": True, "stream_options": {"include_usage": True}}),
    "echo": OnlyAt(False, True),
    "suffix": OnlyAt("", " and that is all."),
}

MESSAGE_KEYS: dict[str, Honoured | Refused] = {
    "role": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost"),
    "content": Honoured(f"{CLIENT_TESTS}::test_chat_plain_records_usage_and_cost"),
    "name": Honoured(f"{HERE}::test_a_speakers_name_reaches_the_prompt"),
    "refusal": Honoured(f"{HERE}::test_a_response_message_replays_in_the_history"),
    "tool_calls": Honoured(f"{TOOLS}::test_forced_call_round_trip_ends_in_a_text_answer"),
    "tool_call_id": Honoured(f"{TOOLS}::test_forced_call_round_trip_ends_in_a_text_answer"),
    "function_call": Refused({"name": "get_time", "arguments": "{}"}),  # the deprecated functions API
    "audio": Refused({"id": "audio_abc"}),
}
PART_TYPES: dict[str, Honoured | Refused] = {
    "text": Honoured(f"{HERE}::test_text_parts_are_read_like_a_string"),
    "image_url": Refused({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
    "input_audio": Refused({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
    "file": Refused({"type": "file", "file": {"file_id": "file-1"}}),
    "refusal": Refused({"type": "refusal", "refusal": "I cannot."}),
}
TEXT_PART_KEYS: dict[str, Honoured | Refused] = {
    "type": Honoured(f"{HERE}::test_text_parts_are_read_like_a_string"),
    "text": Honoured(f"{HERE}::test_text_parts_are_read_like_a_string"),
    "prompt_cache_breakpoint": Refused({"mode": "explicit"}),
}
STREAM_OPTION_KEYS: dict[str, Honoured | OnlyAt] = {
    "include_usage": Honoured(f"{CLIENT_TESTS}::test_chat_streamed_matches_plain_and_reports_usage"),
    "include_obfuscation": OnlyAt(False, True),
}


def keys_of(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def literal(typed_dict: Any, key: str) -> str:
    [value] = typing.get_args(typing.get_type_hints(typed_dict)[key])
    return value


@pytest.fixture(scope="module")
def client(server, tenant_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant_key, max_retries=0)


def assert_refused(call: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


# ---- the walk: every field classified ---------------------------------------------------------

@pytest.mark.parametrize(("sdk", "table"), [(chat_sdk, CHAT_FIELDS), (completion_sdk, COMPLETION_FIELDS)],
                         ids=["chat", "completions"])
def test_every_field_the_sdk_sends_is_classified(sdk, table):
    sent = keys_of(sdk.CompletionCreateParamsStreaming) | keys_of(sdk.CompletionCreateParamsNonStreaming)
    assert sent == set(table)


def test_every_nested_key_the_sdk_sends_is_classified():
    for message in typing.get_args(ChatCompletionMessageParam):
        if literal(message, "role") not in REFUSED_ROLES:
            assert keys_of(message) <= set(MESSAGE_KEYS), message.__name__
    parts = typing.get_args(ChatCompletionContentPartParam) + typing.get_args(ContentArrayOfContentPart)
    assert {literal(p, "type") for p in parts} == set(PART_TYPES)
    text_part = next(p for p in parts if literal(p, "type") == "text")
    assert keys_of(text_part) == set(TEXT_PART_KEYS)
    assert keys_of(ChatCompletionStreamOptionsParam) == set(STREAM_OPTION_KEYS)


def test_each_honoured_field_names_a_test_that_shows_its_effect():
    tables = (CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_KEYS, PART_TYPES, TEXT_PART_KEYS, STREAM_OPTION_KEYS)
    for rule in (r for table in tables for r in table.values() if isinstance(r, Honoured)):
        path, test = rule.effect.split("::")
        module = import_module(path.removesuffix(".py").replace("/", "."))
        assert inspect.isfunction(getattr(module, test, None)), rule.effect


@pytest.mark.parametrize(("model", "base", "table"), [(ChatCompletionRequest, CHAT_BASE, CHAT_FIELDS),
                                                      (CompletionRequest, COMPLETION_BASE, COMPLETION_FIELDS)],
                         ids=["chat", "completions"])
def test_honoured_and_matching_values_are_taken(model, base, table):
    """Parsed and turned into engine parameters, as the gateway does before it runs the model."""
    for name, rule in table.items():
        if isinstance(rule, Honoured):
            to_sampling_params(model.model_validate({**base, **rule.fields}))
        elif isinstance(rule, OnlyAt):
            to_sampling_params(model.model_validate({**base, name: rule.accepted}))


def refusals(table: dict[str, Honoured | OnlyAt | Refused]) -> list[tuple[str, Any]]:
    return [(name, rule.refused if isinstance(rule, OnlyAt) else rule.value) for name, rule in table.items()
            if isinstance(rule, (OnlyAt, Refused))]


@pytest.mark.parametrize(("name", "value"), refusals(CHAT_FIELDS))
def test_a_chat_field_at_a_value_this_server_cannot_honour_is_a_400_naming_it(client, name, value):
    assert_refused(lambda: client.chat.completions.create(**CHAT_BASE, **{name: value}), name)


@pytest.mark.parametrize(("name", "value"), refusals(COMPLETION_FIELDS))
def test_a_completions_field_at_a_value_this_server_cannot_honour_is_a_400_naming_it(client, name, value):
    assert_refused(lambda: client.completions.create(**COMPLETION_BASE, **{name: value}), name)


@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings"])
def test_a_field_no_openai_api_has_is_a_400_naming_it(client, endpoint):
    create = {"chat": lambda **kw: client.chat.completions.create(**CHAT_BASE, **kw),
              "completions": lambda **kw: client.completions.create(**COMPLETION_BASE, **kw),
              "embeddings": lambda **kw: client.embeddings.create(model=MODEL, input="x", **kw)}[endpoint]
    assert_refused(lambda: create(extra_body={"frobnicate": 1}), "frobnicate")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "assistant", "content": "Hi", "audio": {"id": "a1"}}, *ASK]}, "messages.0.audio"),
    ({"messages": [{"role": "user", "content": "Hi", "mood": "happy"}]}, "messages.0.mood"),
    ({"messages": [{"role": "assistant", "content": "Hi", "annotations": [{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "x", "start_index": 0, "end_index": 2}}]}, *ASK]},
     "messages.0.annotations"),
    ({"messages": [{"role": "assistant", "function_call": MESSAGE_KEYS["function_call"].value}, *ASK]},
     "messages.0.function_call"),
    *[({"messages": [{"role": role, "name": "get_time", "content": "12:00"}]}, "messages.0.role")
      for role in REFUSED_ROLES],
    *[({"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, rule.value]}]},
       "messages.0.content.1.type") for rule in PART_TYPES.values() if isinstance(rule, Refused)],
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": {
        "mode": "explicit"}}]}]}, "messages.0.content.0.prompt_cache_breakpoint"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"include_usage": True, "every_token": True}},
     "stream_options.every_token"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
    ({"logit_bias": {"Paris": 5}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),  # outside the vocabulary: the engine says so, still a 400
    ({"user": "alice", "safety_identifier": "bob"}, "safety_identifier"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_nested_key_or_value_this_server_cannot_honour_is_a_400_naming_it(client, body, param):
    chat = {**CHAT_BASE, **body}
    assert_refused(lambda: client.chat.completions.create(**{k: chat.pop(k) for k in ("model", "messages")},
                                                          extra_body=chat), param)


@pytest.mark.parametrize("message", [{"role": "user", "content": "Hi", "mood": "happy"},
                                     {"role": "user", "content": [{"type": "text", "text": "Hi", "mood": "happy"}]}],
                         ids=["message", "content-part"])
def test_an_unknown_nested_key_is_an_unknown_parameter(client, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[message])
    assert caught.value.body["code"] == "unknown_parameter", caught.value.body


@pytest.mark.parametrize(("body", "param"), [
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
], ids=["best_of<n", "best_of-streamed", "negative-token"])
def test_a_completions_value_this_server_cannot_honour_is_a_400_naming_it(client, body, param):
    assert_refused(lambda: client.completions.create(**COMPLETION_BASE, extra_body=body), param)


# ---- the effects of the honoured fields (one model run each, a few tokens) --------------------

def greedy(client, **body) -> Any:
    return client.chat.completions.create(**{**CHAT_BASE, "max_tokens": 12, "temperature": 0, **body})


@pytest.fixture(scope="module")
def plain(client) -> Any:
    return greedy(client)


def usage_event(server, shared_db, request_id: str) -> UsageEvent:
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        return s.scalar(select(UsageEvent).where(UsageEvent.request_id == request_id))


def test_values_that_match_this_server_are_accepted_together(client, server, shared_db, plain):
    r = greedy(client, store=False, service_tier="default", modalities=["text"], reasoning_effort="none",
               prompt_cache_key="checkout-flow", prompt_cache_options={"mode": "implicit"},
               prompt_cache_retention="in_memory", safety_identifier="hashed-user-1", stream=False)
    assert r.choices[0].message.content == plain.choices[0].message.content
    # the safety identifier is the request's end user when `user` is not given
    assert usage_event(server, shared_db, r.id).end_user == "hashed-user-1"


def test_logit_bias_forces_and_bans_tokens(client, backend, plain):
    tokenizer = backend.engine.tokenizer
    [paris] = tokenizer.encode(" Paris", add_special_tokens=False)
    forced = greedy(client, max_tokens=3, logit_bias={str(paris): 100})
    assert forced.choices[0].message.content == " Paris" * 3
    first_tokens = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)[:2]
    banned = greedy(client, logit_bias={str(t): -100 for t in first_tokens})
    assert banned.choices[0].message.content != plain.choices[0].message.content
    completed = client.completions.create(**{**COMPLETION_BASE, "max_tokens": 2, "temperature": 0},
                                          logit_bias={str(paris): 100})
    assert completed.choices[0].text == " Paris Paris"


def test_token_ids_outside_the_vocabulary_are_refused_before_any_model_is_called(client, backend, monkeypatch):
    """A logit_bias key or a prompt token id past the model's embedding rows is the engine's 400, given by the gateway
    from the model's config before it calls the backend: such a request never wakes a model scaled to zero."""
    rows = backend.engine.core.facts.vocab_size  # the running engine's own
    called = []
    generate = backend.generate
    monkeypatch.setattr(backend, "generate", lambda request: called.append(request.request_id) or generate(request))
    assert_refused(lambda: greedy(client, max_tokens=1, logit_bias={str(rows): 5}), "logit_bias")
    assert_refused(lambda: client.completions.create(**{**COMPLETION_BASE, "prompt": [1, rows]}), "prompt")
    assert_refused(lambda: client.completions.create(**COMPLETION_BASE, logit_bias={str(rows + 10**6): -1}),
                   "logit_bias")
    assert called == []
    edge = greedy(client, max_tokens=1, logit_bias={str(rows - 1): 0})
    ids = client.completions.create(**{**COMPLETION_BASE, "prompt": [1, rows - 1]})
    assert called == [edge.id, ids.id]


def test_penalties_change_the_answer(client):
    ask = [{"role": "user", "content": "Write the word 'cat' ten times, separated by spaces."}]
    unpenalised = greedy(client, messages=ask, max_tokens=16).choices[0].message.content
    assert unpenalised.count(" Cat") >= 3  # the unpenalised answer repeats itself
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = greedy(client, messages=ask, max_tokens=16, **penalty).choices[0].message.content
        assert penalised.count(" Cat") < unpenalised.count(" Cat"), (penalty, penalised)


def test_max_completion_tokens_caps_the_answer(client):
    r = greedy(client, max_tokens=40, max_completion_tokens=2)  # the newer name wins
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_stop_ends_the_answer_before_the_stop_text(client, plain):
    text = plain.choices[0].message.content
    word = text.split()[2]
    stopped = greedy(client, stop=[word]).choices[0].message.content
    assert stopped == text[:text.index(word)]


def test_seed_repeats_a_sampled_answer(client, plain):
    sampled = [greedy(client, temperature=1.3, seed=seed, max_tokens=12).choices[0].message.content
               for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1]
    assert len({*sampled, plain.choices[0].message.content}) >= 2  # temperature 1.3 is not the greedy answer


def test_top_p_near_zero_gives_the_greedy_answer(client, plain):
    r = greedy(client, temperature=1.5, top_p=1e-6, seed=1)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_continuous_usage_stats_count_every_chunk(client):
    chunks = list(client.chat.completions.create(**{**CHAT_BASE, "max_tokens": 6, "temperature": 0}, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == chunks[-1].usage.completion_tokens == 6
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    texts = list(client.completions.create(**{**COMPLETION_BASE, "max_tokens": 4, "temperature": 0}, stream=True,
                                           stream_options={"include_usage": True}))
    assert texts[-1].usage.completion_tokens == 4 and "".join(c.choices[0].text for c in texts if c.choices)


def test_best_of_returns_the_likeliest_candidates(client):
    body = {**COMPLETION_BASE, "max_tokens": 5, "temperature": 1.0, "seed": 3}
    candidates = client.completions.create(**body, n=3, logprobs=0)
    best = client.completions.create(**body, best_of=3)
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in candidates.choices}
    [choice] = best.choices
    assert choice.text == max(scores, key=scores.get) and choice.logprobs is None
    assert best.usage.completion_tokens == candidates.usage.completion_tokens  # every candidate is billed


def test_a_speakers_name_reaches_the_prompt(client):
    anonymous = greedy(client, max_tokens=1)
    named = greedy(client, max_tokens=1, messages=[{**ASK[0], "name": "Marie_Curie"}])
    assert named.usage.prompt_tokens > anonymous.usage.prompt_tokens  # "Marie_Curie: " before the question


def test_text_parts_are_read_like_a_string(client, plain):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]
    r = greedy(client, messages=[{"role": "user", "content": parts}])
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_a_response_message_replays_in_the_history(client, plain):
    """The SDK's own response message (with its refusal: null) goes back as history unchanged."""
    follow = [*ASK, plain.choices[0].message, {"role": "user", "content": "And of Italy?"}]
    assert greedy(client, messages=follow, max_tokens=3).choices[0].message.content
    dumped = plain.choices[0].message.model_dump()  # every field, the unset ones as null (annotations, audio, ...)
    assert {"annotations", "audio", "function_call"} <= set(dumped)
    assert greedy(client, messages=[*ASK, dumped, *ASK], max_tokens=3).usage.prompt_tokens == greedy(
        client, messages=[*ASK, {"role": "assistant", "content": dumped["content"]}, *ASK], max_tokens=3
    ).usage.prompt_tokens
    silent = [*ASK, {"role": "assistant", "content": None}, *ASK]
    refused = [*ASK, {"role": "assistant", "content": None, "refusal": "I cannot say that."}, *ASK]
    # the refusal is the assistant's turn
    assert greedy(client, messages=refused, max_tokens=1).usage.prompt_tokens > greedy(
        client, messages=silent, max_tokens=1).usage.prompt_tokens
