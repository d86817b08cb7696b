"""The dashboard tests' data: tenants (one named like markup, one like SQL, two with an end user and a tag of the
same names), keys with projects and budgets (some soft, with an alert share),
usage events over 40 days on two priced models (statuses, end users, tags, cache hits, prefix-cached
tokens, sub-cent costs), end-user and tag budgets (billing/scoped_budgets.py: each starts from its month's
spend), replica intervals split among tenants, and requests in flight holding budget reservations (admitted by
billing/reservations.py against every budget that applies). The tests compute what each view must show from these lists, independently of the views."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.db import dialect_insert
from billing.deployments import record_deployments
from billing.models import ApiKey, GpuShare, ReplicaInterval, SpendCounter, Tenant, UsageEvent
from billing.money import dollars
from billing.reservations import Budgets, Worst, reserve
from billing.scoped_budgets import applicable, set_budget

MODEL = "smollm2-135m"  # deployed from platform/models/smollm2-135m.yaml: $0.05 in, $0.10 out per 1M
BIG = "big-model"
BIG_PRICING = {"input_per_1m": 2.0, "cached_input_per_1m": 0.5, "output_per_1m": 6.0, "gpu_hour": 3.0}
EVIL_TENANT = "<script>alert('x')</script> & co"
DROP = "'; DROP TABLE tenants; --"
EVIL_USER = "<img src=x onerror=alert(1)>"
FORMULA_USER = '=HYPERLINK("http://evil.example","click")'
# name: monthly budget
TENANTS: dict[str, float | None] = {"acme": 100.0, EVIL_TENANT: None, DROP: 0.5, "globex": None, "initech": 20.0,
                                    "beta": None}
# key name: (tenant, project, monthly budget)
KEYS: dict[str, tuple[str, str | None, float | None]] = {
    "ci": ("acme", "search", 5.0), "web": ("acme", "chat", None), "evil": (EVIL_TENANT, "<b>proj</b>", None),
    "drop": (DROP, None, 0.01), "globex-prod": ("globex", "billing", None), "initech-app": ("initech", None, None),
    "beta-app": ("beta", "search", None)}
DROP_USER = "'; DROP TABLE usage_events; --"
# (tenant, scope, name, monthly budget): a user's budget is its tenant's only (initech's alice spent nothing)
SCOPED = [("acme", "user", "alice", "1"), ("acme", "tag", "search", "1"), ("initech", "user", "alice", "3"),
          ("globex", "tag", "batch", "1.5"), (EVIL_TENANT, "user", EVIL_USER, "0.5"),
          (EVIL_TENANT, "user", FORMULA_USER, "2"), (DROP, "tag", "a%", "0.001")]
# soft budgets: (scope, tenant, the key's, end user's or tag's name; None for a tenant's) → alert_at
ALERT_AT: dict[tuple[str, str, str | None], float] = {("tenant", "acme", None): 0.8, ("key", "acme", "ci"): 0.5,
                                                      ("user", "acme", "alice"): 0.9, ("tag", DROP, "a%"): 0.25}
# (tenant, key, worst case, end user, tags) of the requests in flight
IN_FLIGHT = [("acme", "ci", Decimal("0.25"), "alice", ("search",)), ("acme", "ci", Decimal("0.125"), "bob", ("search",)),
             (DROP, "drop", Decimal("0.000004"), DROP_USER, ("a%",))]


@dataclass(frozen=True)
class Seed:
    tenant: str
    ago: int  # days before today (UTC)
    cost: float | str
    model: str = MODEL
    key: str | None = None
    user: str | None = None
    tags: tuple[str, ...] = ()
    status: str = "ok"
    cache_hit: bool = False
    prompt: int = 100
    completion: int = 20
    cached: int = 0

    @property
    def cost_usd(self) -> Decimal:
        return dollars(self.cost)

    @property
    def day(self) -> date:
        return today() - timedelta(days=self.ago)


def _traffic() -> list[Seed]:
    out = []
    for ago in range(28):
        out.append(Seed("globex", ago, 0.3 + (ago % 7) * 0.05, key="globex-prod", user=f"user-{ago % 4}",
                        tags=("billing",), prompt=900 + ago, completion=200))
        if ago % 3 == 0:
            out.append(Seed("globex", ago, 0.8 + (ago % 4) * 0.1, model=BIG, key="globex-prod", user="user-0",
                            tags=("billing", "batch"), prompt=2000, completion=400, cached=500))
        if ago % 4 == 0:  # today's too: every month's invoice has a cache-hit line
            out.append(Seed("globex", ago, 0, model=BIG, key="globex-prod", tags=("billing",), cache_hit=True,
                            prompt=300, completion=150))
        if ago % 2 == 0:
            out.append(Seed("initech", ago, 0.15 + (ago % 5) * 0.04, key="initech-app", user="ops", prompt=400,
                            completion=90, status="failed" if ago % 10 == 0 else "ok"))
        if ago % 9 == 4:
            out.append(Seed("initech", ago, 0.05, key="initech-app", status="interrupted", prompt=50, completion=0))
    return out


SEEDED: list[Seed] = [
    Seed("acme", 0, 0.125, key="ci", user="alice", tags=("search",)),
    Seed("acme", 1, 2.5, key="web", user="bob", tags=("chat", "beta")),
    Seed("acme", 3, 0.0625, key="ci", user="alice", tags=("search",), status="failed"),
    Seed("acme", 40, 1.0, key="web", tags=("chat",)),
    Seed(EVIL_TENANT, 0, 0.5, key="evil", user=EVIL_USER, tags=("<b>proj</b>",)),
    Seed(EVIL_TENANT, 2, 0.25, key="evil", user=FORMULA_USER, tags=("<b>proj</b>",)),
    Seed(DROP, 0, "0.000123", model=BIG, key="drop", user=DROP_USER, tags=("a%",)),
    Seed(DROP, 1, "0.000007", model=BIG, key="drop", tags=("a_c",), status="cancelled"),
    # another tenant's end user and tag of the same names as acme's: not acme's
    Seed("beta", 0, "0.0004", key="beta-app", user="alice", tags=("search",)),
    Seed("beta", 5, 0.75, key="beta-app", user="alice", tags=("search", "chat")),
    *_traffic(),
]


@dataclass(frozen=True)
class Share:
    tenant: str | None  # None: idle time of an interval without work
    busy_s: str
    idle_s: str


# (model, replica, days ago, minutes after 00:05, seconds long, shares): shares add up to the interval
INTERVALS = [
    (BIG, "big-1", 0, 0, 300, [Share("globex", "150.25", "99.5"), Share("initech", "30.25", "20")]),
    (MODEL, "small-1", 0, 5, 300, [Share(None, "0", "300")]),
    (MODEL, "small-1", 1, 0, 60, [Share("acme", "12.000001", "47.999999")]),
]


def today() -> date:
    return datetime.now(timezone.utc).date()


def this_month(s: Seed) -> bool:
    return s.day >= today().replace(day=1)


def created_at(index: int) -> datetime:
    """When SEEDED[index] was recorded: 00:01 UTC of its day, a minute more per index (no two alike)."""
    e = SEEDED[index]
    return datetime.combine(e.day, time(0, 1), tzinfo=timezone.utc) + timedelta(minutes=index)


def chart_total(tenant: str, days: int = 30) -> float:
    return sum(float(s.cost_usd) for s in SEEDED if s.tenant == tenant and s.ago < days)


def seed(db: Engine) -> dict[str, int]:
    """Everything but the reservations; returns the keys' ids by name."""
    for name, budget in TENANTS.items():
        create_tenant(db, name, budget_usd=budget, alert_at=ALERT_AT.get(("tenant", name, None)))
    keys = {name: create_key(db, tenant, name=name, project=project, budget_usd=budget,
                             alert_at=ALERT_AT.get(("key", tenant, name))).id
            for name, (tenant, project, budget) in KEYS.items()}
    record_deployments(db, [{"name": BIG, "pricing": BIG_PRICING}])
    with Session(db) as s, s.begin():
        tenants = {t.name: t for t in s.scalars(select(Tenant))}
        for i, e in enumerate(SEEDED):
            s.add(UsageEvent(request_id=f"seed-{i}", tenant_id=tenants[e.tenant].id, api_key_id=keys.get(e.key or ""),
                             end_user=e.user, tags=list(e.tags), model=e.model, endpoint="chat.completions",
                             status=e.status, prompt_tokens=e.prompt, completion_tokens=e.completion,
                             cached_tokens=e.cached, cache_hit=e.cache_hit, cost_usd=e.cost_usd,
                             latency_s=0.25, created_at=created_at(i)))
        for model, replica, ago, minute, length, shares in INTERVALS:
            begin = datetime.combine(today() - timedelta(days=ago), time(0, 5), tzinfo=timezone.utc) + timedelta(
                minutes=minute)
            row = ReplicaInterval(model=model, replica=replica, start=begin, end=begin + timedelta(seconds=length),
                                  busy_s=sum(Decimal(x.busy_s) for x in shares),
                                  idle_s=sum(Decimal(x.idle_s) for x in shares))
            s.add(row)
            s.flush()
            for x in shares:
                s.add(GpuShare(interval_id=row.id, tenant_uid=tenants[x.tenant].uid if x.tenant else None,
                               busy_s=Decimal(x.busy_s), idle_s=Decimal(x.idle_s)))
    _spend_counters(db, keys)
    for tenant, scope, name, budget in SCOPED:
        set_budget(db, tenant, **{scope: name}, budget_usd=Decimal(budget),
                   alert_at=ALERT_AT.get((scope, tenant, name)))
    return keys


def _spend_counters(db: Engine, keys: dict[str, int]) -> None:
    """This month's spend per tenant and key, as the ledger keeps it with each event it writes."""
    month = today().strftime("%Y-%m")
    with Session(db) as s, s.begin():
        tenant_ids = {t.name: t.id for t in s.scalars(select(Tenant))}
        for scope, ids, of in (("tenant", tenant_ids, lambda e: e.tenant), ("key", keys, lambda e: e.key)):
            for name, scope_id in ids.items():
                spent = sum((e.cost_usd for e in SEEDED if of(e) == name and this_month(e)), Decimal(0))
                s.execute(dialect_insert(db, SpendCounter).values(scope=scope, scope_id=scope_id, period=month,
                                                                  spent_usd=spent, reserved_usd=0))


def hold_reservations(db: Engine, owner: str, keys: dict[str, int]) -> None:
    """Requests admitted by the live gateway `owner` and still running: their worst cases held."""
    with Session(db) as s:
        tenants = {t.name: (t.id, t.budget_usd) for t in s.scalars(select(Tenant))}
        budgets = {k.id: k.budget_usd for k in s.scalars(select(ApiKey))}
    for i, (tenant, key, worst, user, tags) in enumerate(IN_FLIGHT):
        tenant_id, tenant_budget = tenants[tenant]
        with db.connect() as conn:
            scoped = applicable(conn, tenant_id, user, tags)
        admitted = reserve(db, f"in-flight-{i}", owner,
                           Budgets(tenant_id, keys[key], budgets[keys[key]], tenant_budget, None, None, scoped),
                           Worst(worst, 1000), model=MODEL, endpoint="chat.completions")
        assert not hasattr(admitted, "kind"), admitted  # admitted, not refused
