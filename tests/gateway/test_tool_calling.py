"""Tool calling through the live gateway with the official openai client and SmolLM2 (whose chat template has no tool
section: the fallback prompt format). `required` and named calls are enforced by constrained decoding, so every
argument set validates against its function's schema (jsonschema); `auto` parses the model's own format; streamed
deltas add up to the whole call; a bad tool definition is a 400 naming the field before anything is admitted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.models import RateWindow, Reservation, UsageEvent
from billing.reservations import LEASE_ENDPOINT
from gateway.protocol import ChatCompletionRequest
from gateway.tool_calls.plan import tool_plan
from tests.gateway.conftest import MODEL

# reservations held by requests (a gateway's budget lease, billing/budget_leases.py, is none)
REQUEST_HOLDS = select(func.count()).select_from(Reservation).where(Reservation.endpoint != LEASE_ENDPOINT)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40},
                                                    "hour24": {"type": "boolean"}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class GetWeather(BaseModel):
    """The current weather of a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class City(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def client(server, tenant_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant_key, max_retries=0)


def valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """The message's calls as (name, arguments), each checked against its function's schema."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    assert name == "get_weather"
    return f"18 degrees {arguments['unit']}, sunny in {arguments['city']}"


def test_forced_call_round_trip_ends_in_a_text_answer(client, server, shared_db):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=40,
                                           temperature=0)
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = valid_calls(choice.message)
    assert name == "get_weather"
    call = choice.message.tool_calls[0]
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": run_tool(name, arguments)}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    [final] = answer.choices
    assert final.message.tool_calls is None and final.message.content and final.finish_reason in ("stop", "length")
    # the call and its result are in the prompt; with tool_choice "none" the tools are not
    offered = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens < offered.usage.prompt_tokens
    assert offered.usage.prompt_tokens > first.usage.prompt_tokens  # the same tools, a longer history
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        event = s.scalar(select(UsageEvent).where(UsageEvent.request_id == first.id))
    assert event.status == "ok" and event.completion_tokens == first.usage.completion_tokens > 5


def test_required_calls_validate_against_their_schemas_greedy_and_sampled(client):
    asks = [(ASK, {"temperature": 0}),
            ([{"role": "user", "content": "What time is it in Tokyo?"}], {"temperature": 1.0, "seed": 7, "n": 3})]
    for messages, sampling in asks:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, **sampling)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            assert len(valid_calls(choice.message)) == 1  # parallel_tool_calls false: one call


def test_parallel_required_calls_each_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=40,
                                       temperature=0)
    [choice] = r.choices
    calls = choice.message.tool_calls
    whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut by max_tokens
    assert len(whole) >= 1
    choice.message.tool_calls = whole
    valid_calls(choice.message)


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[tuple[str, str]], int, str | None, Any]:
    """The calls a stream's deltas add up to (name, arguments), the most pieces one call's arguments came in, the
    final finish_reason and the usage."""
    calls: dict[int, dict[str, Any]] = {}
    pieces: dict[int, int] = {}
    finish, usage = None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta names it
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                if d.function.arguments:
                    calls[d.index]["arguments"] += d.function.arguments
                    pieces[d.index] = pieces.get(d.index, 0) + 1
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], max(pieces.values()), finish, usage


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_streamed_call_deltas_add_up_to_the_whole_call(client, choice):
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=40,
               temperature=0)
    whole = client.chat.completions.create(**ask)
    calls, pieces, finish, usage = streamed_calls(client, **ask)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert pieces > 3 and finish == whole.choices[0].finish_reason == "tool_calls"
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_parse_fills_pydantic_tool_arguments_and_response_formats(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                      tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                      max_tokens=40, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and call.function.parsed_arguments.city
    beta = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Where is Rome?"}],
                                              response_format=City, max_tokens=40, temperature=0)
    parsed = beta.choices[0].message.parsed
    assert isinstance(parsed, City) and City.model_validate_json(beta.choices[0].message.content) == parsed


# tool_choice auto reads the model's own output; SmolLM2 writes exactly this text when a choice constrains it to
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
NOT_A_CALL = '<tool_call>{"name": "get_date"}</tool_call>'  # not one of the tools


def test_auto_parses_a_hermes_call_the_model_writes_and_leaves_other_text(client):
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(extra_body={"guided_choice": [HERMES_CALL]}, **ask)
    [choice] = whole.choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert valid_calls(choice.message) == [("get_time", {"timezone": "UTC"})]
    calls, _, finish, _ = streamed_calls(client, extra_body={"guided_choice": [HERMES_CALL]}, **ask)
    assert calls == [("get_time", choice.message.tool_calls[0].function.arguments)] and finish == "tool_calls"
    text = client.chat.completions.create(extra_body={"guided_choice": [NOT_A_CALL]}, **ask)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content == NOT_A_CALL
    assert text.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def limited_key(shared_db) -> str:
    """A key with limits and a budget: its requests are admitted (a rate window, a reservation) before they run."""
    create_tenant(shared_db, "toolsmith")
    return create_key(shared_db, "toolsmith", rpm=1000, budget_usd=10).key


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {"a": {"type": "nope"}}}}}
UNENFORCEABLE = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}


def called(call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris", "unit": "celsius"}'
           ) -> dict[str, Any]:
    """An assistant message of the history that called one function."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def two_calls(first: str, second: str) -> dict[str, Any]:
    """An assistant message of the history that called two functions at once."""
    calls = [*called(first)["tool_calls"], *called(second, "get_time", "{}")["tool_calls"]]
    return {**called(first), "tool_calls": calls}


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"tools": [BAD_SCHEMA]}, "tools.0.function.parameters", "not a valid JSON schema"),
    ({"tools": [CLOCK, UNENFORCEABLE], "tool_choice": "required"}, "tools.1.function.parameters", "uniqueItems"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "object"),
    ({"tools": [WEATHER, CLOCK, WEATHER]}, "tools.2.function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested_schema(200)}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "nested deeper"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
     "tool_choice.function.name", "send_email"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "tools"),
    ({"tools": []}, "tools", "at least one"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name", None),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", None),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    # a stop sequence would cut the call's arguments short (they came back as '{"city": "' with "tool_calls")
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "stop": ["Paris"]}, "stop",
     "cannot be combined with tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stop": ","}, "stop",
     "cannot be combined with tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions", "tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0.tool_call_id", "required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls", "assistant"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}, "messages.1.role",
     "assistant"),
    ({"messages": [*ASK, called("call_1"), {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}]},
     "messages.2.tool_call_id", "call_1"),
    ({"messages": [*ASK, called("call_1"), {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                   {"role": "user", "content": "and?"},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}, "messages.4.role", "assistant"),
    # as at OpenAI: each call of an assistant message that more messages follow must be answered by a tool message
    ({"messages": [*ASK, called("call_1"), {"role": "user", "content": "and?"}]}, "messages.1.role",
     "did not have response messages: call_1"),
    ({"messages": [*ASK, two_calls("call_1", "call_2"), {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}]},
     "messages.1.role", "did not have response messages: call_1"),
    ({"messages": [*ASK, called("call_1", arguments='{"city": "Par'),
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]},
     "messages.1.tool_calls.0.function.arguments", "valid JSON"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field_before_admission(server, limited_key, shared_db, body, param,
                                                                       says):
    def held() -> tuple[int, int, int]:
        server.gateway.ledger.flush(10)
        with Session(shared_db) as s:
            return (s.scalar(select(func.count()).select_from(UsageEvent)),
                    s.scalar(REQUEST_HOLDS),
                    s.scalar(select(func.coalesce(func.sum(RateWindow.requests), 0))))

    before = held()
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {limited_key}"},
                   json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: ") and (says is None or says in error["message"]), error
    assert held() == before  # nothing admitted, reserved, run or billed


def test_a_tool_nested_as_deep_as_allowed_compiles_for_enforcement():
    deep = {"type": "function", "function": {"name": "deep", "parameters": nested_schema(31)}}
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "tools": [deep],
                                                 "tool_choice": "required"})
    plan = asyncio.run(tool_plan(body))
    assert plan is not None and plan.constraint is not None and plan.mode == "required"


def test_a_history_call_of_a_function_no_longer_offered_is_accepted(client):
    # as at OpenAI: the tools offered may change between turns, so an earlier call may name one not in `tools`
    history = [*ASK, called("call_1", name="get_forecast", arguments="{}"),
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[CLOCK], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_stop_sequence_is_honoured_where_the_model_chooses_between_text_and_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", stop=["the"],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "the" not in (r.choices[0].message.content or "")


def test_a_last_assistant_message_with_calls_needs_no_answers_yet():
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [*ASK, called("call_1")]})
    assert body.messages[-1].tool_calls[0].id == "call_1"


def test_auto_accepts_a_schema_only_enforced_calls_would_refuse(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[CLOCK, UNENFORCEABLE], max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")



def test_a_forced_call_cut_by_max_tokens_has_null_content(client):
    # cut before the call's name was written (no tool_calls yet), then after (a call with its arguments cut):
    # the output of a forced call is never content, so content is null either way, as at OpenAI
    for max_tokens in (2, 12):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=max_tokens, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
    assert choice.message.tool_calls  # 12 tokens reach the name (the test's premise)
