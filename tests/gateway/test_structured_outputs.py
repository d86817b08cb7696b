"""Structured outputs through the live gateway with the official openai client and SmolLM2: response_format
(json_schema, json_object), `client.chat.completions.parse()` and `.stream()` with a pydantic model, vLLM's extra
parameters (structured_outputs and the older guided_*), on chat and text completions; a bad constraint is a 400 that
names the field before anything is admitted."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.models import UsageEvent
from tests.gateway.conftest import MODEL

ASK = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "population": {"type": "integer", "minimum": 0,
                                                                "maximum": 10**9}},
               "required": ["city", "population"], "additionalProperties": False}


class City(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def client(server, tenant_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant_key, max_retries=0)


def test_json_schema_response_format_is_followed_and_billed(client, server, shared_db):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    [choice] = r.choices
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        event = s.scalar(select(UsageEvent).where(UsageEvent.request_id == r.id))
    assert event.status == "ok" and event.completion_tokens == r.usage.completion_tokens > 5


OPEN_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "facts": {"type": "object", "properties": {"river": {"type": "string",
                                                                                                    "maxLength": 20}}},
                                                 "nickname": {"type": "string", "maxLength": 20}},
               "required": ["city", "facts"]}


def declared_keys_only(document: dict, schema: dict) -> bool:
    return set(document) <= set(schema["properties"]) and all(
        declared_keys_only(document[key], sub) for key, sub in schema["properties"].items()
        if isinstance(document.get(key), dict) and "properties" in sub)


def test_strict_json_schema_writes_no_undeclared_keys(client):
    """OpenAI's strict mode: objects that say nothing of other keys get none (the schema as sent would allow them)."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, n=4, seed=3,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "city", "schema": OPEN_SCHEMA, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        document = json.loads(choice.message.content)
        jsonschema.validate(document, OPEN_SCHEMA)
        assert declared_keys_only(document, OPEN_SCHEMA), document


def test_parse_fills_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=80, temperature=0, response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city and parsed.population >= 0
    assert City.model_validate_json(r.choices[0].message.content) == parsed


def test_streamed_parse_gives_the_same_document_in_pieces(client):
    pieces = []
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=80, temperature=0.7, seed=4,
                                        response_format=City) as stream:
        for event in stream:
            if event.type == "content.delta":
                pieces.append(event.delta)
        final = stream.get_final_completion()
    assert len(pieces) > 3 and "".join(pieces) == final.choices[0].message.content
    assert isinstance(final.choices[0].message.parsed, City)


def test_json_object_and_a_document_cut_by_max_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.LengthFinishReasonError):  # the SDK's own check of finish_reason "length"
        client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=4, temperature=0, response_format=City)


@pytest.mark.parametrize(("extra", "matches"), [
    ({"structured_outputs": {"choice": ["positive", "negative"]}}, lambda t: t in ("positive", "negative")),
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"structured_outputs": {"regex": r"(very )?(good|bad)"}}, lambda t: re.fullmatch(r"(very )?(good|bad)", t)),
    ({"guided_regex": r"[1-5] stars"}, lambda t: re.fullmatch(r"[1-5] stars", t)),
    ({"structured_outputs": {"grammar": 'root ::= "rating: " [1-5]'}}, lambda t: re.fullmatch(r"rating: [1-5]", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_vllm_extra_parameters_on_chat_and_completions(client, extra, matches):
    review = [{"role": "user", "content": "What do you think of this phone? 'Great battery, lovely screen.'"}]
    chat = client.chat.completions.create(model=MODEL, messages=review, max_tokens=30, temperature=0,
                                          extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and matches(chat.choices[0].message.content)
    text = client.completions.create(model=MODEL, prompt="Review: great battery. Verdict:", max_tokens=30,
                                     temperature=0.9, seed=1, extra_body=extra)
    assert text.choices[0].finish_reason == "stop" and matches(text.choices[0].text)


def test_top_logprobs_of_a_constrained_request_name_the_tokens_it_rules_out_at_minus_9999(server, tenant_key):
    """Once a choice's word is written only the end may come: the other top_logprobs had -inf, which JSON cannot carry
    (a 500 before); they are reported at -9999.0 as OpenAI does, in the response and in the stream's chunks."""
    review = [{"role": "user", "content": "Is the sea calm today?"}]
    body = {"model": MODEL, "messages": review, "max_tokens": 5, "temperature": 1.0, "seed": 3, "logprobs": True,
            "top_logprobs": 5, "structured_outputs": {"choice": ["calm", "rough"]}}
    headers = {"Authorization": f"Bearer {tenant_key}"}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert whole.status_code == 200, whole.text
    content = whole.json()["choices"][0]["logprobs"]["content"]
    tops = [[t["logprob"] for t in step["top_logprobs"]] for step in content]
    assert all(len(top) == 5 for top in tops) and all(step["logprob"] > -9999.0 for step in content)
    assert tops[-1].count(-9999.0) == 4  # once the word is whole only its end may come
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                          timeout=120)
    assert streamed.status_code == 200 and "Infinity" not in streamed.text
    chunks = [json.loads(line[6:], parse_constant=lambda c: pytest.fail(f"{c} in a chunk"))
              for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert any(c["choices"] and c["choices"][0]["logprobs"] for c in chunks)
    text = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120, json={
        "model": MODEL, "prompt": "The sea today is", "max_tokens": 5, "logprobs": 3,
        "structured_outputs": {"choice": ["calm", "rough"]}})
    assert text.status_code == 200 and -9999.0 in text.json()["choices"][0]["logprobs"]["top_logprobs"][-1].values()


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema",
     "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "items": {"type": "nonsense"}}}}}}},
     "response_format.json_schema.schema", "(at properties/a/items/type)"),
    ({"guided_json": {"type": "object", "required": "a"}}, "guided_json", "(at required)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra", None),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "missing"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", None),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one of"),
    # a stop sequence would cut the document short (it came back invalid, finish_reason "stop"); ignore_eos would
    # write past its end
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "cannot be combined with response_format"),
    ({"structured_outputs": {"choice": ["Rome city", "Milan city"]}, "stop": " "}, "stop",
     "cannot be combined with structured_outputs"),
    ({"guided_regex": "[a-z]+", "ignore_eos": True}, "ignore_eos", "cannot be combined with guided_regex"),
])
def test_a_bad_constraint_is_a_400_naming_its_field_before_admission(server, tenant_key, shared_db, body, param,
                                                                     says):
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        before = s.scalar(select(func.count()).select_from(UsageEvent))
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant_key}"},
                   json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    unknown = param.endswith((".extra", ".whitespace_pattern"))
    assert error["code"] == ("unknown_parameter" if unknown else "invalid_value")
    assert error["message"].startswith(f"{param}: ") and (says is None or says in error["message"])
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        assert s.scalar(select(func.count()).select_from(UsageEvent)) == before  # nothing ran, nothing billed

