"""A client leaving mid-stream aborts the engine request; limits hold across two gateways."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.models import Tenant, UsageEvent
from tests.gateway.conftest import MODEL, make_server


def test_disconnect_mid_stream_aborts_and_records_cancelled(server, backend, shared_db, tenant_key):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 500, "stream": True, "temperature": 0, "ignore_eos": True}
    received = 0
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {tenant_key}"}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    received += 1
                    if received == 3:
                        break
    deadline = time.monotonic() + 60
    while (backend.stats()["num_running"] or backend.stats()["kv_blocks_used"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = backend.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
    server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        ev = s.scalar(select(UsageEvent).where(UsageEvent.request_id == request_id))
    assert ev.status == "cancelled"
    assert 3 <= ev.completion_tokens < 500 and ev.prompt_tokens > 0 and ev.cost_usd > 0


def test_rpm_holds_across_two_gateways_on_one_database(shared_db_url, shared_db, backend, spec):
    create_tenant(shared_db, "twins")
    key = create_key(shared_db, "twins", rpm=4).key
    a = make_server(shared_db_url, backend, spec)
    b = make_server(shared_db_url, backend, spec)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        def call(i: int) -> int:
            url = (a if i % 2 else b).url + "/v1/chat/completions"
            return httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120).status_code

        if time.time() % 60 > 50:  # keep all ten calls inside one rate window
            time.sleep(61 - time.time() % 60)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            codes = sorted(pool.map(call, range(10)))
    finally:
        a.stop()
        b.stop()  # both ledgers flush on shutdown
    assert codes == [200] * 4 + [429] * 6
    with Session(shared_db) as s:
        count = s.scalar(select(func.count()).select_from(UsageEvent).join(Tenant)
                         .where(Tenant.name == "twins", UsageEvent.status == "ok"))
    assert count == 4

