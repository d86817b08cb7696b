"""bench/load.py end to end at a tiny size against the in-process gateway: concurrent streaming and
whole requests over two tenants (one rate-limited), then the ledger reconciliation and the chart."""

from __future__ import annotations

import argparse
import asyncio

from sqlalchemy import Engine

from bench.load import Tenant, run_load, summary
from bench.load_chart import load_svg
from bench.load_ledger import reconcile
from billing.accounts import create_key, create_tenant
from tests.gateway.live import LiveServer


def test_load_run_reconciles_with_the_ledger(server: LiveServer, shared_db: Engine, shared_db_url: str) -> None:
    tenants = []
    for name, rpm in (("load-a", None), ("load-b", 0)):
        create_tenant(shared_db, name)
        tenants.append(Tenant(name, create_key(shared_db, name, rpm=rpm).key, rpm))
    args = argparse.Namespace(url=server.url, model="smollm2-135m", seconds=4.0, concurrency=3, max_tokens=3,
                              repeat_fraction=0.3, request_timeout=60.0, seed=0)
    run = asyncio.run(run_load(args, tenants))
    report = summary(run)
    assert report["completed"] >= 3 and not report["unexpected"]
    assert report["streamed"] >= 1 and report["ttft_p50_s"] is not None
    assert report["statuses"].get("429", 0) >= 1  # load-b may make no request (rpm 0): 429 by design
    ledger = reconcile(run.all_results, ["load-a", "load-b"], None, shared_db_url, wait_s=20)
    assert ledger["ok"], ledger
    assert ledger["usage_events"] == report["completed"] + 1 == ledger["completed_requests"]  # + the warm-up
    assert ledger["ledger_tokens"] == ledger["client_tokens"]
    report["ledger"] = ledger
    svg = load_svg(run.results, run.duration_s, report)
    assert svg.startswith("<svg") and "reconciled" in svg and "NOT" not in svg
