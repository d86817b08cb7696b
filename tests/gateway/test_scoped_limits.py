"""End-user and tag budgets in admission and the ledger: a request holds its worst case against every budget that
applies, all or nothing; its usage event settles each to the exact cost; a refusal after admission and a dead
gateway's sweep release them; a budget set mid-month starts from what was spent this month."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from sqlalchemy import select

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.models import ScopedBudget, SpendCounter, UsageEvent
from billing.reservations import DEAD_AFTER_S, Worst, heartbeat, sweep_orphans
from billing.scoped_budgets import delete_budget, list_budgets, set_budget
from gateway.auth import KeyStore
from gateway.errors import APIError
from gateway.limits import Limiter

_ids = itertools.count()
D = Decimal


def _admit(limiter: Limiter, p, cost: str, user: str | None = None, tags: tuple[str, ...] = (),
           now: float | None = None) -> str:
    rid = f"s{next(_ids)}"
    limiter.admit(p, rid, Worst(D(cost), 0), model="m", endpoint="chat.completions", end_user=user, tags=tags,
                  now=now)
    return rid


def _event(rid: str, p, cost: str, user: str | None = None, tags: list[str] | None = None,
           created_at: datetime | None = None) -> UsageEvent:
    return UsageEvent(request_id=rid, tenant_id=p.tenant_id, api_key_id=p.key_id, end_user=user, tags=tags or [],
                      model="m", endpoint="chat.completions", status="ok", cost_usd=D(cost), created_at=created_at)


def _counters(db) -> dict[str, tuple[Decimal, Decimal]]:
    """(spent, reserved) this month of each budget, by "key", "tenant", "user:NAME" or "tag:NAME"."""
    out = {f"{u.scope}:{u.name}": (u.spent_usd, u.reserved_usd) for u in list_budgets(db)}
    with db.connect() as conn:
        for scope, spent, reserved in conn.execute(select(SpendCounter.scope, SpendCounter.spent_usd,
                                                          SpendCounter.reserved_usd)
                                                   .where(SpendCounter.scope.in_(["key", "tenant"]))):
            out[scope] = (spent, reserved)
    return out


def _acme(db, **key_limits):
    create_tenant(db, "acme", budget_usd=5)
    created = create_key(db, "acme", budget_usd=5, **key_limits)
    return created


def test_a_refusal_by_one_budget_holds_nothing_on_the_others(db) -> None:
    key = _acme(db)
    set_budget(db, "acme", user="alice", budget_usd=D("0.5"))
    set_budget(db, "acme", tag="search", budget_usd=5)
    p = KeyStore(db, ttl_s=0).authenticate(f"Bearer {key.key}")
    assert p.scoped_budgets
    limiter = Limiter(db)
    _admit(limiter, p, "0.3", user="alice", tags=("search", "search"))  # a tag twice holds once
    held = {"key": (0, D("0.3")), "tenant": (0, D("0.3")), "user:alice": (0, D("0.3")), "tag:search": (0, D("0.3"))}
    assert _counters(db) == held
    with pytest.raises(APIError) as info:
        _admit(limiter, p, "0.3", user="alice", tags=("search",))
    assert info.value.code == "insufficient_quota"
    assert info.value.message.startswith("End user 'alice' has $0.20 left of its monthly budget of $0.50 ($0.00 "
                                         "spent, $0.30 held by requests in flight); this request may cost up to $0.30")
    assert _counters(db) == held  # all or nothing: the key, tenant and tag budgets that had room hold nothing more
    _admit(limiter, p, "0.3", user="bob", tags=("search",))  # another user of the key is not touched
    _admit(limiter, p, "0.3", user="ALICE")  # names match exactly
    assert _counters(db)["tag:search"] == (0, D("0.6")) and _counters(db)["user:alice"] == (0, D("0.3"))
    create_tenant(db, "other")
    set_budget(db, "other", user="zed", budget_usd=1)  # so that admission looks up this tenant's budgets too
    theirs = KeyStore(db).authenticate(f"Bearer {create_key(db, 'other').key}")
    for _ in range(3):  # another tenant's alice and search are not acme's
        _admit(limiter, theirs, "0.3", user="alice", tags=("search",))
    assert _counters(db)["tag:search"] == (0, D("0.6")) and _counters(db)["user:alice"] == (0, D("0.3"))


def test_usage_events_settle_every_budget_to_the_exact_cost(db) -> None:
    key = _acme(db, project="search")
    set_budget(db, "acme", user="alice", budget_usd=1)
    set_budget(db, "acme", tag="search", budget_usd=1)
    set_budget(db, "acme", tag="nightly", budget_usd=1)
    p = KeyStore(db).authenticate(f"Bearer {key.key}")
    ledger = Ledger(db).start()
    limiter = Limiter(db, ledger)
    tags = ["search", "nightly", "search"]  # the key's project, then the request's metadata.tags
    first = _admit(limiter, p, "0.4", user="alice", tags=tags)
    second = _admit(limiter, p, "0.4", user="alice", tags=tags)
    limiter.release(second)  # refused after admission: it goes back whole
    ledger.record(_event(first, p, "0.123456789", user="alice", tags=tags))
    ledger.record(_event("no-reservation", p, "0.1", user="alice"))  # admitted while the database was down
    ledger.flush()
    exact = D("0.123456789")
    assert _counters(db) == {"key": (exact + D("0.1"), 0), "tenant": (exact + D("0.1"), 0),
                             "user:alice": (exact + D("0.1"), 0), "tag:search": (exact, 0), "tag:nightly": (exact, 0)}
    ledger.close()


def test_a_dead_gateways_holds_on_end_user_and_tag_budgets_are_released(db) -> None:
    key = _acme(db)
    set_budget(db, "acme", user="alice", budget_usd=1)
    set_budget(db, "acme", tag="search", budget_usd=1)
    p = KeyStore(db).authenticate(f"Bearer {key.key}")
    now = time.time()
    dead = Limiter(db, owner="host:1:dead")
    heartbeat(db, dead.owner, now=now - DEAD_AFTER_S - 5)
    _admit(dead, p, "0.7", user="alice", tags=("search",), now=now - DEAD_AFTER_S - 5)
    with pytest.raises(APIError, match="^End user 'alice' has \\$0.30 left"):
        _admit(Limiter(db), p, "0.5", user="alice")
    assert sweep_orphans(db, now=now) == 1
    assert _counters(db) == {"key": (0, 0), "tenant": (0, 0), "user:alice": (0, 0), "tag:search": (0, 0)}
    _admit(Limiter(db), p, "0.9", user="alice", tags=("search",))


def test_a_budget_set_mid_month_starts_from_this_months_spend(db) -> None:
    key = _acme(db, project="search")
    other = create_key(db, create_tenant(db, "other").name)
    p, q = (KeyStore(db).authenticate(f"Bearer {k.key}") for k in (key, other))
    last_month = datetime.now(timezone.utc).replace(day=1) - timedelta(days=1)
    ledger = Ledger(db).start()
    ledger.record(_event("a1", p, "0.25", user="alice", tags=["search"]))
    ledger.record(_event("a0", p, "7", user="alice", tags=["search"], created_at=last_month))  # another month
    ledger.record(_event("b1", q, "3", user="alice", tags=["search"]))  # another tenant's alice and tag
    ledger.record(_event("t1", p, "0.5", tags=["search", "x"]))
    ledger.flush()
    set_budget(db, "acme", user="alice", budget_usd=1)
    set_budget(db, "acme", tag="search", budget_usd=1, alert_at=0.9)
    assert _counters(db)["user:alice"] == (D("0.25"), 0) and _counters(db)["tag:search"] == (D("0.75"), 0)
    ledger.record(_event("a2", p, "0.5", user="alice", tags=["search"]))
    ledger.flush()
    assert _counters(db)["user:alice"] == (D("0.75"), 0) and _counters(db)["tag:search"] == (D("1.25"), 0)
    [search] = [u for u in list_budgets(db, "acme") if u.scope == "tag"]
    assert (search.budget_usd, search.alert_at, search.left_usd) == (1, 0.9, 0)
    with pytest.raises(APIError, match="^Tag 'search' has \\$0.00 left"):
        _admit(Limiter(db), KeyStore(db).authenticate(f"Bearer {key.key}"), "0.01", tags=("search",))
    # set again: the budget changes, its spend stays; deleted and set again: it starts from the month's events
    set_budget(db, "acme", user="alice", budget_usd=2)
    assert _counters(db)["user:alice"] == (D("0.75"), 0)
    delete_budget(db, "acme", user="alice")
    assert "user:alice" not in _counters(db)
    assert set_budget(db, "acme", user="alice", budget_usd=2).spent_usd == D("0.75")
    with db.connect() as conn:
        assert sorted(conn.execute(select(ScopedBudget.id)).scalars()) == [2, 3]  # ids are never reused
    ledger.close()


def test_an_in_flight_request_settles_after_its_budget_was_deleted(db) -> None:
    key = _acme(db)
    set_budget(db, "acme", user="alice", budget_usd=1)
    p = KeyStore(db).authenticate(f"Bearer {key.key}")
    ledger = Ledger(db).start()
    rid = _admit(Limiter(db, ledger), p, "0.5", user="alice")
    delete_budget(db, "acme", user="alice")
    ledger.record(_event(rid, p, "0.2", user="alice"))
    ledger.close()
    assert _counters(db) == {"key": (D("0.2"), 0), "tenant": (D("0.2"), 0)}
    with db.connect() as conn:
        assert conn.execute(select(SpendCounter.reserved_usd).where(SpendCounter.scope == "user")).scalar_one() == 0
