"""Hostile HTTP input against a live gateway with the real model: random JSON, wrong types, huge
numbers, odd Unicode (unpaired surrogates, RTL and zero-width marks, NUL), deep nesting and bodies at
the size limit, on the OpenAI routes, the admin API and the dashboard's forms. Never a 500, never a
hung request (every request runs under a client timeout), errors in OpenAI's shape, and a usage event
for exactly the requests that were served."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from urllib.parse import quote_from_bytes
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from billing.models import ApiKey, Tenant, UsageEvent
from tests.billing.dbutil import fresh_database
from tests.gateway.conftest import MODEL, make_server
from tests.gateway.live import LiveServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ADMIN_KEY = "tga-hostile-input-admin"
BODY_LIMIT = 64 * 1024
TIMEOUT = httpx.Timeout(30.0)
FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
ODD_TEXT = ["\ud800", "a\udfffb", "\u202eevil\u202c", "zero\u200bwidth\u200d", "nul\x00here", "\ufeffbom",
            "e\u0301\u0301\u0301", "\U0001f600" * 3, "'; DROP TABLE tenants; --", "%_\\", "\u0000", ""]
HUGE_NUMBERS = [2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, float("inf"), float("-inf"),
                float("nan")]


@dataclass
class Hostile:
    live: LiveServer
    db: Engine
    key: str

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key or self.key}", "Content-Type": "application/json"}
        return httpx.Client(base_url=self.live.url, headers=headers, timeout=TIMEOUT)

    def events(self) -> int:
        assert self.live.gateway.ledger.flush(10)
        with Session(self.db) as s:
            return s.scalar(select(func.count()).select_from(UsageEvent)) or 0

    def assert_recorded(self, before: int, r: httpx.Response) -> None:
        """One usage event for a served request (a stream records its event once the stream has ended)."""
        expected = before + (1 if r.status_code == 200 else 0)
        deadline = time.monotonic() + 10
        while self.events() < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.events() == expected


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, backend, spec) -> Iterator[Hostile]:
    with fresh_database(tmp_path_factory.mktemp("hostile")) as url:
        live = make_server(url, backend, spec, max_body_bytes=BODY_LIMIT, admin_key=ADMIN_KEY)
        db = make_engine(url)
        create_tenant(db, "acme")
        yield Hostile(live, db, create_key(db, "acme", project="fuzz").key)
        live.stop()
        db.dispose()


@pytest.fixture(scope="module")
def http(hostile) -> Iterator[httpx.Client]:
    with hostile.client() as c:
        yield c


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def assert_handled(r: httpx.Response) -> None:
    """Served, or refused in OpenAI's shape; a stream, when served, ends with [DONE]."""
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        else:
            assert r.json()["usage"]["completion_tokens"] >= 0
        return
    assert_openai_error(r)


def post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body)


def dumps(body: Any, ascii: bool = True) -> bytes:
    """json.dumps as a hostile client sends it: NaN and Infinity as bare tokens, surrogates as \\ud800."""
    return json.dumps(body, allow_nan=True, ensure_ascii=ascii).encode()


# ---- hypothesis strategies ------------------------------------------------------------------

odd_text = st.one_of(st.sampled_from(ODD_TEXT),
                     st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()),
                             max_size=12))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(HUGE_NUMBERS),
                    st.floats(allow_nan=True, allow_infinity=True), odd_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(odd_text, inner, max_size=3), max_leaves=8)

# every request field but the length ones: a huge max_tokens would only make the test slow (it has its own case)
CHAT_FIELDS = ["model", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
               "stream", "stream_options", "user", "metadata", "ignore_eos"]
message_values = st.one_of(json_values, st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "wizard"]), json_values),
     "content": st.one_of(odd_text, json_values, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": odd_text}), max_size=2))}),
    min_size=1, max_size=3))


def mutated(base: dict[str, Any], fields: list[str], special: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    def apply(changes: dict[str, Any]) -> dict[str, Any]:
        return {**base, **changes}

    values = {f: special.get(f, st.one_of(PLAUSIBLE[f], json_values) if f in PLAUSIBLE else json_values)
              for f in fields}
    return st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({f: values[f] for f in chosen}).map(apply))


# values a client might well send, next to the hostile ones: about half the bodies reach the model
PLAUSIBLE = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 2**70), "min_p": st.floats(0, 1), "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=5)), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.sampled_from([1e-300, 0.5, 1.0, 1e300, 2**64]),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 25), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": odd_text,
    "metadata": st.fixed_dictionaries({"tags": st.one_of(odd_text, st.lists(odd_text, max_size=3))}),
    "ignore_eos": st.booleans(), "echo": st.booleans(), "suffix": odd_text,
}
CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION_BASE = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
chat_mutations = mutated(CHAT_BASE, CHAT_FIELDS, {"messages": message_values})
chat_bodies = st.one_of(chat_mutations, chat_mutations, chat_mutations, json_values)  # 3 in 4: mutations
completion_mutations = mutated(
    COMPLETION_BASE, [f for f in CHAT_FIELDS if f != "messages"] + ["prompt", "echo", "suffix"],
    {"prompt": st.one_of(odd_text, json_values, st.lists(st.integers(-(2**65), 2**65), max_size=4),
                         st.lists(st.lists(st.integers(-5, 60_000), max_size=3), max_size=2))})
completion_bodies = st.one_of(completion_mutations, completion_mutations, completion_mutations, json_values)


@FUZZ
@given(chat_bodies)
def test_fuzzed_chat_bodies_are_served_or_refused_never_a_500(hostile, http, body):
    before = hostile.events()
    r = post_raw(http, CHAT, dumps(body))
    assert_handled(r)
    hostile.assert_recorded(before, r)
    event(f"status {r.status_code}")


@FUZZ
@given(completion_bodies)
def test_fuzzed_completion_bodies_are_served_or_refused_never_a_500(hostile, http, body):
    before = hostile.events()
    r = post_raw(http, COMPLETIONS, dumps(body))
    assert_handled(r)
    hostile.assert_recorded(before, r)
    event(f"status {r.status_code}")


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(0x20, 0xFF).filter(lambda b: b != 0x7F), max_size=40).map(bytes), odd_text)
def test_fuzzed_headers_and_queries_on_models_are_401_or_served(hostile, header, query):
    url = hostile.live.url + "/v1/models?q=" + quote_from_bytes(query.encode("utf-8", "surrogatepass"), safe="")
    # h11 itself refuses to send leading or trailing whitespace in a header value
    r = httpx.get(url, headers={"Authorization": (b"Bearer " + header).strip()}, timeout=TIMEOUT)
    assert r.status_code in (400, 401, 429), r.text  # 429: the throttle after many bad keys from one address
    if r.status_code != 400:  # 400: the HTTP server's own refusal of a malformed header line
        assert_openai_error(r)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(json_values)
def test_fuzzed_admin_bodies_are_refused_in_openai_shape(hostile, body):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    r = httpx.post(hostile.live.url + "/admin/cache/flush", content=dumps(body), headers=admin, timeout=TIMEOUT)
    assert_openai_error(r)  # a bad body is a 400; a good one too here, since this gateway runs no cache


# ---- deep nesting, sizes, odd Unicode ---------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/admin/cache/flush"])
def test_deep_nesting_is_a_400_or_413_never_a_recursion_error(hostile, path):
    with hostile.client(ADMIN_KEY if path.startswith("/admin") else None) as c:
        for depth in (10_000, 30_000):  # 30k nested arrays = 60 KB: under the 64 KiB limit
            arrays = b"[" * depth + b"]" * depth
            objects = b'{"a":' * (depth // 3) + b"1" + b"}" * (depth // 3)
            for body in (arrays, objects, b'{"model": "m", "metadata": ' + arrays + b"}",
                         b'{"model": "m", "messages": ' + arrays + b"}"):
                r = c.post(path, content=body)
                assert r.status_code == (413 if len(body) > BODY_LIMIT else 400), r.text[:300]
                assert_openai_error(r)
        too_big = c.post(path, content=b"[" * 200_000 + b"]" * 200_000)
        assert too_big.status_code == 413 and assert_openai_error(too_big)["code"] == "request_too_large"
        # nested just under the parser's limit still parses, and is refused by the schema
        r = c.post(path, content=b'{"model": "m", "metadata": {"tags": ' + b"[" * 500 + b"]" * 500 + b"}}")
        assert r.status_code == 400


def test_strings_at_the_body_limit(hostile, http):
    before = hostile.events()
    envelope = dumps({**CHAT_BASE, "messages": [{"role": "user", "content": ""}]})
    room = BODY_LIMIT - len(envelope)
    for content in ("é" * (room // 2), "\u200b" * (room // 3), "x" * room):  # multi-byte and ASCII, exactly full
        body = dumps({**CHAT_BASE, "messages": [{"role": "user", "content": content}]}, ascii=False)
        assert BODY_LIMIT - 3 <= len(body) <= BODY_LIMIT
        err = assert_openai_error(post_raw(http, CHAT, body))
        assert err["code"] == "context_length_exceeded"
    over = dumps({**CHAT_BASE, "messages": [{"role": "user", "content": "x" * (room + 1)}]})
    assert assert_openai_error(post_raw(http, CHAT, over))["code"] == "request_too_large"
    name = "m" * (room - 10)
    assert assert_openai_error(post_raw(http, CHAT, dumps({**CHAT_BASE, "model": name})))["code"] == "model_not_found"
    many = dumps({**CHAT_BASE, "messages": [{"role": "user", "content": "hi"}] * 1500})
    assert assert_openai_error(post_raw(http, CHAT, many))["code"] == "context_length_exceeded"
    for max_tokens in (2**64, 10**30):  # no overflow on the way to the engine's length check
        over_long = {"model": MODEL, "prompt": list(range(100, 1200)), "max_tokens": max_tokens}
        assert assert_openai_error(post_raw(http, COMPLETIONS, dumps(over_long)))["code"] == "context_length_exceeded"
    assert hostile.events() == before


@pytest.mark.parametrize("change, param", [
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages.0.content.0.text"),
    ({"stop": "\ud83d"}, "stop"),
    ({"metadata": {"note": ["\ud800"]}}, "metadata.note.0"),
    ({"user": "someone\x00else"}, "user"),
    ({"metadata": {"tags": ["ok", "nul\x00"]}}, "metadata.tags"),
    ({"metadata": {"tags": [["nested"]]}}, "metadata.tags"),
    ({"metadata": {"tags": ["t"] * 33}}, "metadata.tags"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
def test_text_that_cannot_be_tokenized_or_stored_is_a_400_naming_the_field(hostile, http, change, param):
    before = hostile.events()
    err = assert_openai_error(post_raw(http, CHAT, dumps({**CHAT_BASE, **change})))
    assert err["param"] == param, err
    assert hostile.events() == before


def test_odd_but_valid_unicode_is_served_and_recorded_verbatim(hostile, http):
    odd = "\u202eevil\u202c zero\u200bwidth \x00 \ufeff e\u0301 \U0001f600 '; DROP TABLE tenants; -- %_\\"
    r = post_raw(http, CHAT, dumps({**CHAT_BASE, "messages": [{"role": "user", "content": odd}],
                                    "user": odd.replace("\x00", ""), "metadata": {"tags": ["%", "_", "a'b"]}}))
    assert r.status_code == 200, r.text
    hostile.events()
    with Session(hostile.db) as s:
        event = s.scalar(select(UsageEvent).where(UsageEvent.request_id == r.json()["id"]))
        assert event.end_user == odd.replace("\x00", "") and event.tags == ["fuzz", "%", "_", "a'b"]
        assert s.scalar(select(func.count()).select_from(Tenant)) >= 1  # the tenants table is intact


# ---- the dashboard's forms --------------------------------------------------------------------

def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, html[:500]
    return found.group(1)


@pytest.fixture(scope="module")
def dashboard(hostile) -> Iterator[tuple[httpx.Client, str]]:
    with httpx.Client(base_url=hostile.live.url, timeout=TIMEOUT) as c:
        form = c.get("/admin/login")
        assert c.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": ADMIN_KEY}).status_code == 303
        yield c, csrf_of(c.get("/admin/keys").text)


form_text = st.one_of(odd_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.sampled_from([b"1e308", b"99999999999999999999", b"-0", b"nan", b"inf", b"0x10", b"-1",
                                       b"2147483648", b"\xff\xfe", b"%00", b"acme"]),
                      st.binary(max_size=12))
FORM_FIELDS = ["tenant", "name", "project", "rpm", "tpm", "budget_usd"]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({f: form_text for f in FORM_FIELDS}), st.sampled_from(
    ["/admin/keys", "/admin/keys/1/limits", "/admin/keys/99999999999999999999/limits",
     "/admin/keys/99999999999999999999/revoke", "/admin/keys/-1/limits"]))
def test_fuzzed_dashboard_forms_are_pages_never_a_500(hostile, dashboard, fields, path):
    client, csrf = dashboard
    with Session(hostile.db) as s:
        keys_before = s.scalar(select(func.count()).select_from(ApiKey))
    body = "&".join(f"{k}={quote_from_bytes(v, safe='')}" for k, v in fields.items()) + f"&csrf_token={csrf}"
    r = client.post(path, content=body.encode(), headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code in (200, 303, 400, 404), (r.status_code, r.text[:300])
    with Session(hostile.db) as s:
        created = s.scalar(select(func.count()).select_from(ApiKey)) - keys_before
    assert created == (1 if path == "/admin/keys" and r.status_code == 200 else 0)


def test_dashboard_queries_and_login_take_odd_input(hostile, dashboard):
    client, _ = dashboard
    for params in ({"tenant": "\x00", "days": "99999999999999999999"}, {"tenant": "'; DROP TABLE tenants; --"},
                   {"days": "1e308"}, {"tenant": "%"}):
        assert client.get("/admin/tenants", params=params).status_code in (200, 400)
    anonymous = httpx.Client(base_url=hostile.live.url, timeout=TIMEOUT)
    form = anonymous.get("/admin/login")
    for key in ("\x00", "é" * 10_000, "' OR '1'='1"):
        r = anonymous.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": key})
        assert r.status_code in (401, 429) and "admin" in r.text
    r = anonymous.post("/admin/login", content=b"key=\xff\xfe&csrf_token=" + csrf_of(form.text).encode(),
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 403 and "security token" in r.text  # not UTF-8: no fields, so no CSRF token
    r = anonymous.post("/admin/login", content=b"k" * 70_000)
    assert r.status_code == 413
