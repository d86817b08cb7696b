"""Faults the gateway rides out (in one process, without Ray; the Ray Serve ones are in test_serve.py):
the database unavailable for a while (SQLite locked, or PostgreSQL behind a cut proxy), the gateway
stopped with a stream in flight, a failing semantic cache, and an engine out of KV blocks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from billing.accounts import create_key, create_tenant
from billing.models import UsageEvent
from gateway.app import create_app
from gateway.backends import LocalEngineBackend
from gateway.settings import Settings
from gateway.specs import ModelSpec
from tests.billing.outage import Outage, outage_of
from tests.gateway.live import LiveServer, start


@pytest.fixture
def outage(db_url: str) -> Iterator[Outage]:
    with outage_of(db_url, busy_timeout_s=0.3) as o:
        yield o


def _gateway(url: str, engine: Engine, backend: Any, spec: ModelSpec, spill: Path, **settings: Any) -> LiveServer:
    s = Settings(database_url=url, key_cache_ttl_s=0.0, semantic_cache=False, ledger_spill_dir=spill,
                 admission_db_timeout_s=0.3, **settings)
    return start(create_app(s, engine, {spec.name: backend}, [spec]))


def _chat(live: LiveServer, key: str, model: str, question: str, stream: bool = False,
          max_tokens: int = 4) -> tuple[httpx.Response, str | None, dict[str, Any] | None]:
    """(response, request id, usage the client was given)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    if r.status_code != 200:
        return r, None, None
    if not stream:
        return r, r.json()["id"], r.json()["usage"]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return r, chunks[0]["id"], chunks[-1]["usage"]


def _events(db: Engine, ids: list[str]) -> dict[str, UsageEvent]:
    with db.connect() as conn:
        rows = conn.execute(select(UsageEvent).where(UsageEvent.request_id.in_(ids))).all()
    return {r.request_id: r for r in rows}


def _all_events(db: Engine, ids: list[str]) -> dict[str, UsageEvent] | None:
    events = _events(db, ids)
    return events if len(events) == len(ids) else None


def _wait(predicate, timeout: float, what: str) -> Any:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
    return value


def test_database_outage_serves_requests_and_loses_no_usage(outage: Outage, db: Engine, backend: LocalEngineBackend,
                                                            spec: ModelSpec, tmp_path: Path) -> None:
    create_tenant(db, "acme")
    free = create_key(db, "acme").key
    limited = create_key(db, "acme", rpm=1000, tpm=1_000_000, budget_usd=100.0).key  # admission reads the database
    spill = tmp_path / "spill"
    live = _gateway(outage.url, outage.engine, backend, spec, spill)
    served: dict[str, dict[str, Any]] = {}
    try:
        for key in (free, limited):  # both keys seen once while the database is up
            r, rid, u = _chat(live, key, spec.name, f"Warm up {key[-4:]}.")
            assert r.status_code == 200, r.text
            served[rid] = u  # type: ignore[index]
        outage.take_down()
        for i in range(4):
            r, rid, u = _chat(live, (free, limited)[i % 2], spec.name, f"Question {i} in the outage.",
                              stream=i >= 2)
            assert r.status_code == 200, r.text  # fail open: admission and auth do not need the database
            served[rid] = u  # type: ignore[index]
        unknown = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": "Bearer tg-unknown"},
                             json={"model": spec.name, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        # SQLite in WAL mode still reads (the key is simply wrong); PostgreSQL cannot be asked: 503, not 500
        assert unknown.status_code == (401 if outage.url.startswith("sqlite") else 503), unknown.text
        assert len(_events(db, list(served))) <= 2  # the outage's events are not in the database
        assert live.gateway.ledger.backlog >= 4
    finally:
        live.stop()  # stopped during the outage: the ledger puts what it holds on disk
    assert sum(1 for _ in spill.rglob("usage-*.jsonl")) >= 1
    outage.bring_back()
    replacement = _gateway(outage.url, outage.engine, backend, spec, spill)  # replays the stopped one's events
    try:
        events = _wait(lambda: _all_events(db, list(served)), 20, "every served request's usage event")
    finally:
        replacement.stop()
    for rid, u in served.items():
        e = events[rid]
        assert (e.status, e.prompt_tokens, e.completion_tokens) == ("ok", u["prompt_tokens"], u["completion_tokens"])
    assert not list(spill.rglob("usage-*"))


def test_gateway_stopped_mid_stream_finishes_it_and_writes_its_usage(db_url: str, db: Engine,
                                                                    backend: LocalEngineBackend, spec: ModelSpec,
                                                                    tmp_path: Path) -> None:
    from billing.db import make_engine

    create_tenant(db, "acme")
    key = create_key(db, "acme").key
    live = _gateway(db_url, make_engine(db_url), backend, spec, tmp_path / "spill")
    body = {"model": spec.name, "messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 12,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                live.server.should_exit = True  # graceful shutdown while the stream is in flight
                # the listener closes at once: new requests are refused, not half-served
                _wait(lambda: _refused(live.url), 10, "the listener to close")
    live.thread.join(120)
    assert not live.thread.is_alive()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    usage = chunks[-1]["usage"]
    # the server stopped after the lifespan closed the ledger: the event is already written
    [event] = _events(db, [chunks[0]["id"]]).values()
    assert (event.status, event.completion_tokens, event.prompt_tokens) == ("ok", 12, usage["prompt_tokens"])


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


class FailingCache:
    """A semantic cache that fails on purpose: every lookup raises or hangs past the gateway's bound."""

    def __init__(self, hang_s: float = 0.0) -> None:
        self.hang_s = hang_s
        self.lookups = 0

    def consult(self, namespace: Any, prompt: str, embedding: Any = None, max_false_hit_rate: Any = None) -> Any:
        self.lookups += 1
        if self.hang_s:
            time.sleep(self.hang_s)
            raise TimeoutError("cache lookup timed out")
        raise ConnectionError("semantic cache deployment unreachable")

    def store(self, namespace: Any, prompt: str, answer: str, usage: dict[str, Any]) -> int:
        raise ConnectionError("semantic cache deployment unreachable")

    def close(self) -> None:
        pass


def test_failing_cache_sends_requests_to_the_model(server: LiveServer, tenant_key: str, spec: ModelSpec) -> None:
    reuse = server.gateway.reuse
    saved = reuse.cache
    reuse.cache = cache = FailingCache()  # type: ignore[assignment]
    try:
        for stream in (False, True):
            r, rid, u = _chat(server, tenant_key, spec.name, "What is the capital of France?", stream=stream)
            assert r.status_code == 200, r.text
            assert u is not None and u["completion_tokens"] > 0
            assert "x-tollgate-cache" not in r.headers  # no cache decision: the model answered
        assert cache.lookups == 2
        _wait(lambda: reuse.pending_stores == 0, 10, "the failed stores to finish")
    finally:
        reuse.cache = saved


def test_engine_out_of_kv_blocks_preempts_and_serves_everyone(db_url: str, db: Engine, spec: ModelSpec,
                                                             tmp_path: Path) -> None:
    from billing.db import make_engine

    data = spec.model_dump(mode="json")
    data.update(name="tiny", source="random:llama-tiny")
    data["engine"] = {"max_model_len": 256, "max_num_seqs": 8, "num_kv_blocks": 10}  # 160 token slots
    tiny = ModelSpec.model_validate(data)
    backend = LocalEngineBackend(tiny)
    create_tenant(db, "acme")
    key = create_key(db, "acme").key
    s = Settings(database_url=db_url, key_cache_ttl_s=0.0, semantic_cache=False, ledger_spill_dir=tmp_path / "spill")
    live = start(create_app(s, make_engine(db_url), {"tiny": backend}, [tiny], own_backends=True))
    headers = {"Authorization": f"Bearer {key}"}
    try:
        def complete(i: int, prompt_len: int = 29, max_tokens: int = 60) -> httpx.Response:
            body = {"model": "tiny", "prompt": list(range(1 + i, prompt_len + 1 + i)), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{live.url}/v1/completions", json=body, headers=headers, timeout=60)

        # six sequences of 89 tokens need 36 blocks at their longest: the engine must preempt
        results: list[httpx.Response] = [None] * 6  # type: ignore[list-item]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(i))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200] * 6, [r.text for r in results]
        assert [r.json()["usage"]["completion_tokens"] for r in results] == [60] * 6
        stats = backend.stats()
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
        # one request that can never fit the pool is a 400 naming the field, and the engine serves on
        too_big = complete(0, prompt_len=170, max_tokens=10)
        assert too_big.status_code == 400 and "KV blocks" in too_big.json()["error"]["message"]
        assert complete(7).status_code == 200
        assert backend.info().state == "ready"
    finally:
        live.stop()
    assert len(_events(db, [r.json()["id"] for r in results])) == 6
