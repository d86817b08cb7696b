from datetime import datetime, timedelta, timezone

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.models import UsageEvent
from billing.usage import usage_frame


def test_usage_grouped_by_day_and_model(db):
    a = create_tenant(db, "acme")
    b = create_tenant(db, "globex")
    ka = create_key(db, "acme")
    kb = create_key(db, "globex")
    day1 = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
    day2 = day1 + timedelta(days=1)
    ledger = Ledger(db).start()
    rows = [("r1", a.id, ka.id, "small", day1, 0.5), ("r2", a.id, ka.id, "small", day1, 0.25),
            ("r3", a.id, ka.id, "large", day2, 1.0), ("r4", b.id, kb.id, "small", day2, 2.0)]
    for rid, t, k, model, when, cost in rows:
        ledger.record(UsageEvent(request_id=rid, tenant_id=t, api_key_id=k, model=model, endpoint="completions",
                                 status="ok", prompt_tokens=3, completion_tokens=2, cost_usd=cost, created_at=when))
    ledger.close()

    frame = usage_frame(db, tenant="acme", group_by=("day", "model"))
    assert frame.to_dict("records") == [
        {"day": "2026-03-01", "model": "small", "requests": 2, "prompt_tokens": 6, "completion_tokens": 4,
         "cached_tokens": 0, "cost_usd": 0.75},
        {"day": "2026-03-02", "model": "large", "requests": 1, "prompt_tokens": 3, "completion_tokens": 2,
         "cached_tokens": 0, "cost_usd": 1.0},
    ]
    by_tenant = usage_frame(db, group_by=("tenant",), since=day2 - timedelta(hours=1))
    assert by_tenant[["tenant", "requests", "cost_usd"]].values.tolist() == [["acme", 1, 1.0], ["globex", 1, 2.0]]
