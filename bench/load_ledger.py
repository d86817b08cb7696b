"""The ledger side of bench/load.py: every request the clients completed has exactly one usage event,
and the ledger's tokens equal the tokens the clients were given (their `usage` fields)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from sqlalchemy import select

from billing.db import make_engine
from billing.models import Tenant, UsageEvent
from gateway.settings import Settings


def reconcile(results: list[Any], tenants: list[str], home: str | None, database_url: str | None,
              wait_s: float = 60.0) -> dict[str, Any]:
    """`results`: bench.load Results. Reads the usage events of the run's tenants, waiting up to wait_s for
    the batched ledger to catch up."""
    engine = make_engine(Settings.load(home=home, database_url=database_url).db_url)
    completed = {r.request_id: r for r in results if r.status == 200}
    query = (select(UsageEvent.request_id, UsageEvent.status, UsageEvent.prompt_tokens, UsageEvent.completion_tokens)
             .join(Tenant, Tenant.id == UsageEvent.tenant_id).where(Tenant.name.in_(tenants)))
    deadline = time.monotonic() + wait_s
    while True:
        with engine.connect() as conn:
            rows = conn.execute(query).all()
        seen = {r.request_id for r in rows}
        if all(rid in seen for rid in completed) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    engine.dispose()
    per_id = Counter(r.request_id for r in rows)
    events = {r.request_id: r for r in rows}
    missing = [rid for rid in completed if rid not in events]
    duplicates = [rid for rid, n in per_id.items() if n > 1]
    mismatched = [rid for rid, r in completed.items() if rid in events
                  and (events[rid].prompt_tokens, events[rid].completion_tokens, events[rid].status)
                  != (r.usage["prompt_tokens"], r.usage["completion_tokens"], "ok")]
    # events no client saw complete: only failed or cancelled ones may exist (a client that gave up)
    extra = Counter(r.status for r in rows if r.request_id not in completed)
    client = _tokens([r.usage for r in completed.values()])
    ledger = _tokens([{"prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens}
                      for rid, e in events.items() if rid in completed])
    return {
        "ok": not missing and not duplicates and not mismatched and extra.get("ok", 0) == 0 and client == ledger,
        "completed_requests": len(completed), "usage_events": len(rows), "missing": missing[:20],
        "duplicates": duplicates[:20], "token_mismatches": mismatched[:20], "events_not_completed": dict(extra),
        "client_tokens": client, "ledger_tokens": ledger,
    }


def _tokens(usages: list[dict[str, int]]) -> dict[str, int]:
    return {"prompt": sum(u["prompt_tokens"] for u in usages),
            "completion": sum(u["completion_tokens"] for u in usages)}
