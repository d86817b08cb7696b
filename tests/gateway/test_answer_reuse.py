"""The semantic cache and the task router on the live gateway: hits come back in the live shapes,
never cross tenants, are billed at the cache price, and `model: "auto"` is routed and recorded."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from billing.models import ReplicaInterval, Tenant, UsageEvent
from tests.gateway.conftest import MODEL, make_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN_KEY = "tg-admin-test-secret"


@pytest.fixture(scope="module")
def reuse_server(tmp_path_factory, backend, spec):
    from tests.billing.dbutil import fresh_database

    home = tmp_path_factory.mktemp("home")
    with fresh_database(tmp_path_factory.mktemp("db")) as url:
        live = make_server(url, backend, spec, semantic_cache=True, home=home, admin_key=ADMIN_KEY)
        db = make_engine(url)
        create_tenant(db, "alpha")
        create_tenant(db, "beta")
        keys = {"alpha": create_key(db, "alpha").key, "beta": create_key(db, "beta").key}
        yield live, db, keys
        live.stop()
        db.dispose()


def chat(live, key: str, **body) -> httpx.Response:
    """One request, returned once the gateway has stored its answer (stores run after the response)."""
    payload = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0, **body}
    response = httpx.post(f"{live.url}/v1/chat/completions", json=payload,
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)
    deadline = time.monotonic() + 30
    while live.gateway.reuse.pending_stores and time.monotonic() < deadline:
        time.sleep(0.01)
    return response


def events(live, db) -> list[UsageEvent]:
    live.gateway.ledger.flush(10)
    with Session(db) as s:
        return list(s.scalars(select(UsageEvent).order_by(UsageEvent.id)))


def test_repeat_is_served_from_cache_within_one_tenant_only(reuse_server):
    live, db, keys = reuse_server
    first = chat(live, keys["alpha"])
    assert first.status_code == 200 and first.headers["x-tollgate-cache"] == "miss"
    again = chat(live, keys["alpha"])
    assert again.status_code == 200 and again.headers["x-tollgate-cache"] == "hit"
    assert float(again.headers["x-tollgate-cache-similarity"]) > 0.99
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert again.json()["usage"] == first.json()["usage"]
    assert again.json()["choices"][0]["finish_reason"] == first.json()["choices"][0]["finish_reason"]
    short = [chat(live, keys["alpha"], max_tokens=2) for _ in range(2)]  # cut short: the hit says so too
    assert [r.headers["x-tollgate-cache"] for r in short] == ["miss", "hit"]
    assert [r.json()["choices"][0]["finish_reason"] for r in short] == ["length", "length"]
    other = chat(live, keys["beta"])  # the same question from another tenant never sees alpha's entry
    assert other.status_code == 200 and other.headers["x-tollgate-cache"] == "miss"

    by_id = {e.request_id: e for e in events(live, db)}
    live_event, hit_event = by_id[first.json()["id"]], by_id[again.json()["id"]]
    assert not live_event.cache_hit and live_event.cost_usd > 0
    assert hit_event.cache_hit and hit_event.cost_usd == 0.0 and hit_event.status == "ok"
    # the hit's tokens are the ones it saved
    assert (hit_event.prompt_tokens, hit_event.completion_tokens) == (live_event.prompt_tokens,
                                                                      live_event.completion_tokens)


def test_hit_streams_like_a_live_answer(reuse_server):
    live, _, keys = reuse_server
    live_text = chat(live, keys["alpha"]).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {keys['alpha']}"},
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["x-tollgate-cache"] == "hit"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == live_text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_structured_request_is_never_answered_with_free_text(reuse_server):
    live, _, keys = reuse_server
    assert chat(live, keys["beta"]).headers["x-tollgate-cache"] in ("miss", "hit")  # a free-text answer is stored
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"],
        "additionalProperties": False}}}
    structured = [chat(live, keys["beta"], response_format=fmt, max_tokens=20) for _ in range(2)]
    assert [r.headers["x-tollgate-cache"] for r in structured] == ["miss", "hit"]  # its own namespace
    assert [json.loads(r.json()["choices"][0]["message"]["content"]) for r in structured][0]["capital"]
    assert structured[0].json()["choices"][0]["message"] == structured[1].json()["choices"][0]["message"]
    extra = chat(live, keys["beta"], structured_outputs={"choice": ["Paris", "Lyon"]}, max_tokens=20)
    assert extra.headers["x-tollgate-cache"] == "miss" and extra.json()["choices"][0]["message"]["content"] in (
        "Paris", "Lyon")


def test_a_request_under_other_constraints_is_never_answered_from_the_cache(reuse_server):
    live, _, keys = reuse_server
    assert chat(live, keys["alpha"]).headers["x-tollgate-cache"] in ("miss", "hit")  # the plain answer is stored
    for changed in ({"logit_bias": {"42": -100}}, {"stop": ["Paris"]}, {"seed": 7}):  # all of them: test_namespace.py
        assert chat(live, keys["alpha"], **changed).headers["x-tollgate-cache"] == "miss", changed
    with_logprobs = chat(live, keys["alpha"], logprobs=True)  # a cached answer has no logprobs to give
    assert with_logprobs.headers["x-tollgate-cache"] == "skip"
    assert with_logprobs.json()["choices"][0]["logprobs"]["content"]
    # who asks and how it is delivered change nothing: the stored answer serves
    same = chat(live, keys["alpha"], user="someone", store=False, service_tier="auto", prompt_cache_key="k")
    assert same.headers["x-tollgate-cache"] == "hit"


def test_sampled_requests_are_not_cached(reuse_server):
    live, _, keys = reuse_server
    r = chat(live, keys["alpha"], temperature=0.7, seed=1)
    assert r.status_code == 200 and r.headers["x-tollgate-cache"] == "skip"


def test_auto_is_routed_and_recorded(reuse_server):
    live, db, keys = reuse_server
    r = chat(live, keys["beta"], model="auto",
             messages=[{"role": "user", "content": "Summarize: the meeting moved to Tuesday at noon."}])
    assert r.status_code == 200
    assert r.json()["model"] == MODEL
    route = r.headers["x-tollgate-route"]
    assert route.startswith("summarization") and f"model={MODEL}" in route
    event = {e.request_id: e for e in events(live, db)}[r.json()["id"]]
    assert event.route == "summarization" and event.model == MODEL


def test_admin_flush_removes_one_tenants_entries(reuse_server):
    live, _, keys = reuse_server
    question = [{"role": "user", "content": "Name one primary colour."}]
    for tenant in ("alpha", "beta"):
        assert chat(live, keys[tenant], messages=question).headers["x-tollgate-cache"] == "miss"
        assert chat(live, keys[tenant], messages=question).headers["x-tollgate-cache"] == "hit"

    def flush(key: str | None, tenant: str = "alpha") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{live.url}/admin/cache/flush", json={"tenant": tenant}, headers=headers, timeout=30)

    assert flush(None).status_code == 401
    refused = flush(keys["alpha"])  # a tenant's own API key is not an admin key
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
    assert flush(ADMIN_KEY, "nobody").status_code == 400
    done = flush(ADMIN_KEY)
    assert done.status_code == 200 and done.json()["flushed"] >= 1
    assert chat(live, keys["alpha"], messages=question).headers["x-tollgate-cache"] == "miss"
    assert chat(live, keys["beta"], messages=question).headers["x-tollgate-cache"] == "hit"


def test_metrics_count_cache_hits_and_tenant_spend(reuse_server):
    live, db, keys = reuse_server
    chat(live, keys["alpha"])
    assert chat(live, keys["alpha"]).headers["x-tollgate-cache"] == "hit"
    chat(live, keys["beta"], messages=[{"role": "user", "content": "Spell 'metrics'."}])  # beta spends
    now = datetime.now(timezone.utc)
    with Session(db) as s, s.begin():  # one replica alive 2 minutes, busy 30 s of them
        s.add(ReplicaInterval(model=MODEL, replica="r1", start=now - timedelta(minutes=3),
                              end=now - timedelta(minutes=1), busy_s=30.0, idle_s=90.0))
    text = httpx.get(f"{live.url}/metrics", timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert f'tollgate_model_replicas{{model="{MODEL}",state="running"}} 1.0' in text
    assert f'tollgate_model_gpu_idle_ratio{{model="{MODEL}"}} 0.75' in text
    hits = [line for line in text.splitlines() if line.startswith("tollgate_cache_hits_total{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1
    assert any(line.startswith('tollgate_tenant_spend_usd_total{tenant="beta"}') for line in text.splitlines())



def test_nothing_a_client_sends_moves_it_into_another_tenants_cache(reuse_server):
    live, db, keys = reuse_server
    question = [{"role": "user", "content": "Which planet is known as the red planet?"}]
    assert chat(live, keys["beta"], messages=question).headers["x-tollgate-cache"] == "miss"
    assert chat(live, keys["beta"], messages=question).headers["x-tollgate-cache"] == "hit"
    # alpha claims to be beta in every field a body has; the namespace comes from the key alone
    spoofed = chat(live, keys["alpha"], messages=question, model="auto", user="beta",
                   metadata={"tenant": "beta", "tenant_id": 2, "tags": ["beta"]})
    assert spoofed.status_code == 200 and spoofed.headers["x-tollgate-cache"] == "miss"
    # the admin flush takes names with SQL metacharacters as plain names; tables stay intact
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name in ("'; DROP TABLE tenants; --", "%", "b%", "_eta", "\\", "beta' OR '1'='1"):
        r = httpx.post(f"{live.url}/admin/cache/flush", json={"tenant": name}, headers=admin, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "tenant_not_found", name
    r = httpx.post(f"{live.url}/admin/cache/flush", json={"tenant": "beta\x00"}, headers=admin, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    assert chat(live, keys["beta"], messages=question).headers["x-tollgate-cache"] == "hit"
    with Session(db) as s:
        assert sorted(s.scalars(select(Tenant.name))) == ["alpha", "beta"]


def test_a_home_reused_with_another_database_never_serves_its_tenants(backend, spec, tmp_path_factory):
    """Cache entries are keyed by the tenant's uid, which no other database shares: a gateway started on a home
    another gateway used, with another database whose tenant has the same id and name, misses."""
    from tests.billing.dbutil import fresh_database

    home = tmp_path_factory.mktemp("shared-home")
    question = [{"role": "user", "content": "Which ocean is the largest?"}]
    headers = []
    for database in ("first", "second"):  # one after the other, as with a copied home directory
        with fresh_database(tmp_path_factory.mktemp(database)) as url:
            db = make_engine(url)
            create_tenant(db, "alpha")  # id 1 in both databases
            key = create_key(db, "alpha").key
            live = make_server(url, backend, spec, semantic_cache=True, home=home)
            try:
                headers += [chat(live, key, messages=question).headers["x-tollgate-cache"] for _ in range(2)]
            finally:
                live.stop()
                db.dispose()
    assert headers == ["miss", "hit", "miss", "hit"]


PARIS = [{"role": "user", "content": "What is the capital of France?"}]
WHICH_CITY = [{"role": "user", "content": "Which city is the capital of France?"}]  # verifier ~0.974 against PARIS
TELL_ME = [{"role": "user", "content": "Tell me the capital of France."}]  # ~0.974 too


def feedback(live, key: str | None, body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{live.url}/v1/cache/feedback", json=body, headers=headers, timeout=30)


def test_near_miss_is_answered_by_the_model_and_says_learning(reuse_server):
    live, _, keys = reuse_server
    chat(live, keys["alpha"], messages=PARIS, max_tokens=9)
    near = chat(live, keys["alpha"], messages=WHICH_CITY, max_tokens=9)  # default bound 1%: threshold ~0.986
    assert near.status_code == 200 and near.headers["x-tollgate-cache"] == "learning"
    score, threshold = float(near.headers["x-tollgate-cache-score"]), float(near.headers["x-tollgate-cache-threshold"])
    assert 0.9 < score < threshold < 1.0
    assert near.json()["usage"]["completion_tokens"] > 0  # the model answered


def test_each_key_serves_at_its_own_bound_and_the_tenant_can_flag_a_hit(reuse_server):
    live, db, keys = reuse_server
    create_tenant(db, "gamma", cache_max_false_hit_rate=0.05)
    loose = create_key(db, "gamma").key  # the tenant's 5%
    strict = create_key(db, "gamma", cache_max_false_hit_rate=0.002).key
    assert chat(live, loose, messages=PARIS, max_tokens=10).headers["x-tollgate-cache"] == "miss"
    assert chat(live, strict, messages=WHICH_CITY, max_tokens=10).headers["x-tollgate-cache"] == "miss"
    chat(live, loose, messages=PARIS, max_tokens=11)
    served = chat(live, loose, messages=WHICH_CITY, max_tokens=11)
    assert served.headers["x-tollgate-cache"] == "hit"
    assert float(served.headers["x-tollgate-cache-threshold"]) < float(served.headers["x-tollgate-cache-score"])
    response_id = served.json()["id"]

    assert feedback(live, keys["beta"], {"response_id": response_id}).status_code == 404  # not beta's answer
    unknown = feedback(live, loose, {"response_id": "chatcmpl-nothing-like-it"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"
    for bad in ({}, {"response_id": 7}, {"response_id": ""}, {"response_id": response_id, "entry": 1}):
        r = feedback(live, loose, bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
    assert feedback(live, None, {"response_id": response_id}).status_code == 401

    flagged = feedback(live, strict, {"response_id": response_id})  # any key of the tenant may flag
    assert flagged.status_code == 200
    body = flagged.json()
    assert body["flagged"] and not body["entry_removed"] and body["entry_threshold"] > body["score"] > 0.9
    again = chat(live, loose, messages=WHICH_CITY, max_tokens=11)  # the flagged entry no longer serves it
    assert again.headers["x-tollgate-cache"] == "learning"
    assert float(again.headers["x-tollgate-cache-threshold"]) > float(again.headers["x-tollgate-cache-score"])


def test_flagging_a_word_for_word_hit_removes_the_entry(reuse_server):
    live, _, keys = reuse_server
    question = [{"role": "user", "content": "Name the largest planet."}]
    chat(live, keys["beta"], messages=question)
    hit = chat(live, keys["beta"], messages=question)
    assert hit.headers["x-tollgate-cache"] == "hit"
    flagged = feedback(live, keys["beta"], {"response_id": hit.json()["id"]})
    assert flagged.status_code == 200 and flagged.json()["entry_removed"] is True
    assert chat(live, keys["beta"], messages=question).headers["x-tollgate-cache"] == "miss"


def test_dashboard_shows_each_tenants_bound_hit_rate_savings_and_flagged_answers(reuse_server):
    import csv
    import io

    from tests.gateway.test_dashboard import csrf_of

    live, db, _ = reuse_server
    create_tenant(db, "delta-co", cache_max_false_hit_rate=0.05)
    key = create_key(db, "delta-co").key
    create_key(db, "delta-co", cache_max_false_hit_rate=0.002)
    chat(live, key, messages=PARIS, max_tokens=13)
    served = chat(live, key, messages=WHICH_CITY, max_tokens=13)
    assert served.headers["x-tollgate-cache"] == "hit"
    assert feedback(live, key, {"response_id": served.json()["id"]}).status_code == 200
    live.gateway.ledger.flush(10)

    admin = httpx.Client(base_url=live.url, timeout=30)
    form = admin.get("/admin/login")
    assert admin.post("/admin/login", data={"csrf_token": csrf_of(form.text), "key": ADMIN_KEY}).status_code == 303
    page = admin.get("/admin/cache", params={"tenant": "delta-co"})
    assert page.status_code == 200
    row = page.text.split('data-tenant="delta-co"')[1].split("</tr>")[0]
    assert "5.0%" in row and "1 key with their own" in row and "(50.0%)" in row  # 1 hit of 2 requests
    flags = page.text.split('id="cache-flags"')[1].split("</table>")[0]
    assert served.json()["id"] in flags and "What is the capital of France?" in flags
    assert "stopped at that score" in flags

    bounds = admin.get("/admin/cache/bounds", params={"tenant": "delta-co", "format": "json"}).json()
    assert [(b["tenant"], b["max_false_hit_rate"], b["keys_with_own_bound"], b["requests"], b["cache_hits"],
             b["flagged"]) for b in bounds] == [("delta-co", 0.05, 1, 2, 1, 1)]
    assert bounds[0]["serving_threshold"] == bounds[0]["calibrated_threshold"]  # nothing learned from 0 labels
    exported = list(csv.DictReader(io.StringIO(admin.get("/admin/cache/flags", params={"tenant": "delta-co",
                                                                                        "format": "csv"}).text)))
    assert [(f["tenant"], f["response_id"], f["entry_removed"]) for f in exported] == [
        ("delta-co", served.json()["id"], "false")]
    everyone = admin.get("/admin/cache/flags", params={"format": "json"}).json()
    assert served.json()["id"] in {f["response_id"] for f in everyone} and len(everyone) >= 1
    nobody = admin.get("/admin/cache/flags", params={"tenant": "no-such-tenant", "format": "json"}).json()
    assert nobody == []
    admin.close()


def test_an_explored_would_be_hit_is_answered_by_the_model_and_teaches_the_tenant(reuse_server):
    live, db, _ = reuse_server
    create_tenant(db, "epsilon-co", cache_max_false_hit_rate=0.05)
    key = create_key(db, "epsilon-co").key
    chat(live, key, messages=PARIS, max_tokens=14)
    cache = live.gateway.reuse.cache
    cache.explore = 1.0
    try:
        explored = chat(live, key, messages=WHICH_CITY, max_tokens=14)  # a hit at 5% without exploration
    finally:
        cache.explore = 0.0
    assert explored.status_code == 200 and explored.headers["x-tollgate-cache"] == "learning"
    assert float(explored.headers["x-tollgate-cache-score"]) >= float(explored.headers["x-tollgate-cache-threshold"])
    assert explored.json()["usage"]["completion_tokens"] > 0  # the model answered
    with Session(db) as s:
        tenant_uid = s.scalar(select(Tenant.uid).where(Tenant.name == "epsilon-co"))
    assert cache.label_count(tenant_uid) == 1  # its answer labelled the lookup for the tenant's threshold
