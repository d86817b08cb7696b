"""Names and filters with SQL metacharacters are plain text: stored and returned verbatim, matched
exactly (a filter "a%" never matches "abc", "_" never matches one character), no SQL error, tables
intact. Values a column cannot hold (NUL, unpaired surrogates, over-long names, integers past 2**31)
are a ValueError naming the field before any SQL runs. Runs on SQLite, and on PostgreSQL when
TOLLGATE_TEST_DATABASE_URL is set (tests/billing/dbutil.py)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.orm import Session

from billing.accounts import (AccountError, create_key, create_tenant, get_or_create_tenant, list_keys, list_tenants,
                              revoke_key, set_tenant_budget)
from billing.invoice import build_invoice
from billing.key_limits import set_key_limits
from billing.models import ModelDeployment, Tenant, UsageEvent
from billing.reports import usage_by_tenant_day_model
from billing.usage import usage_frame
from gateway.cli import main

DROP = "'; DROP TABLE tenants; --"
NAMES = ["abc", "a%", "a_c", "_", "%", "a\\", "a\\%", 'quo"te', "it's", DROP, "x' OR '1'='1", "\u202eevil",
         "名前", "a" * 200]
WHEN = datetime(2026, 11, 15, 12, tzinfo=timezone.utc)


def seed_usage(db) -> None:  # type: ignore[no-untyped-def]
    with Session(db) as s, s.begin():
        s.add(ModelDeployment(name=DROP, spec={"name": DROP}, input_per_1m=1.0, output_per_1m=2.0))
        for i, name in enumerate(NAMES):
            tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == name))
            s.add(UsageEvent(request_id=f"r{i}", tenant_id=tenant_id, created_at=WHEN + timedelta(minutes=i),
                             end_user=name, tags=[name, "common"], model=DROP if i % 2 else "m%",
                             endpoint="chat.completions", status="ok", prompt_tokens=10 + i, completion_tokens=1,
                             cost_usd=0.5))


@pytest.fixture
def accounts(db):  # type: ignore[no-untyped-def]
    for name in NAMES:
        create_tenant(db, name, budget_usd=5.0)
        create_key(db, name, name=name, project=name)
    return db


def test_names_are_stored_and_returned_verbatim(accounts):
    assert [t.name for t in list_tenants(accounts)] == NAMES
    for name in NAMES:
        keys = list_keys(accounts, name)
        assert [(k.tenant, k.name, k.project) for k in keys] == [(name, name, name)], name
        assert get_or_create_tenant(accounts, name).name == name
        set_tenant_budget(accounts, name, 7.0)
    assert len(list_keys(accounts)) == len(NAMES)
    assert inspect(accounts).has_table("tenants")


def test_filters_match_exactly_never_as_patterns(accounts):
    assert list_keys(accounts, "a%")[0].tenant == "a%" and len(list_keys(accounts, "a%")) == 1
    assert list_keys(accounts, "a_") == [] and list_keys(accounts, "%%") == [] and list_keys(accounts, "A%") == []
    with pytest.raises(AccountError, match="no tenant named"):
        create_key(accounts, "ab%")
    with pytest.raises(AccountError, match="no key"):
        revoke_key(accounts, "tg-%")  # a display prefix with a wildcard matches no key
    with pytest.raises(AccountError, match="already exists"):
        create_tenant(accounts, DROP)

    seed_usage(accounts)
    by = {g: usage_frame(accounts, group_by=("tenant",), **{g: v})
          for g, v in (("tenant", "a%"), ("user", "a_c"), ("tag", "%"))}
    assert by["tenant"]["tenant"].tolist() == ["a%"]
    assert by["user"]["tenant"].tolist() == ["a_c"]
    assert by["tag"]["tenant"].tolist() == ["%"]
    assert usage_frame(accounts, tag="common", group_by=())["requests"].tolist() == [len(NAMES)]
    for pattern in ("a_", "%%", "a\\_c", "ABC"):
        for field in ("tenant", "user", "tag"):
            assert usage_frame(accounts, group_by=(), **{field: pattern})["requests"].tolist() == [0], (field, pattern)
    # dates: a half-open window, compared as timestamps
    window = usage_frame(accounts, since=WHEN + timedelta(minutes=1), until=WHEN + timedelta(minutes=3), group_by=())
    assert window["requests"].tolist() == [2]
    # every value comes back as it went in
    users = usage_frame(accounts, group_by=("tenant", "user", "model"))
    assert sorted(zip(users["tenant"], users["user"])) == sorted(zip(NAMES, NAMES))
    assert set(users["model"]) == {DROP, "m%"}
    report = usage_by_tenant_day_model(accounts)
    assert sorted(report["tenant"]) == sorted(NAMES)
    assert report.loc[report["model"] == DROP, "revenue_usd"].gt(0).all()  # priced through the DROP-named model
    assert build_invoice(accounts, DROP, "2026-11").requests == 1
    with Session(accounts) as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == len(NAMES)
        assert s.scalar(select(func.count()).select_from(UsageEvent)) == len(NAMES)


@pytest.mark.parametrize("call, field", [
    (lambda db: create_tenant(db, "nul\x00"), "name"),
    (lambda db: create_tenant(db, "\ud800"), "name"),
    (lambda db: create_tenant(db, "a" * 201), "name"),
    (lambda db: create_tenant(db, "ok", budget_usd=float("nan")), "budget_usd"),
    (lambda db: create_key(db, "acme", name="x\x00"), "name"),
    (lambda db: create_key(db, "acme", project="\udfff"), "project"),
    (lambda db: create_key(db, "acme", rpm=2**31), "rpm"),
    (lambda db: create_key(db, "acme", tpm=2**64), "tpm"),
    (lambda db: create_key(db, "acme", budget_usd=float("inf")), "budget_usd"),
    (lambda db: create_key(db, "acme\x00"), "tenant"),
    (lambda db: list_keys(db, "acme\x00"), "tenant"),
    (lambda db: set_key_limits(db, 1, rpm=10**30, tpm=None, budget_usd=None), "rpm"),
    (lambda db: usage_frame(db, tenant="\x00"), "tenant"),
    (lambda db: usage_frame(db, user="u\x00"), "user"),
    (lambda db: usage_frame(db, tag="\ud800"), "tag"),
    (lambda db: build_invoice(db, "acme\x00", "2026-11"), "tenant"),
])
def test_values_a_column_cannot_hold_are_refused_naming_the_field(db, call, field):
    create_tenant(db, "acme")
    with pytest.raises(ValueError, match=f"^{field}: "):
        call(db)
    assert [t.name for t in list_tenants(db)] == ["acme"]


def test_huge_key_ids_are_unknown_keys_not_sql_errors(db):
    create_tenant(db, "acme")
    for key_id in ("99999999999999999999", str(2**31)):
        with pytest.raises(AccountError, match="no key"):
            revoke_key(db, key_id)
    with pytest.raises(AccountError, match="no key"):
        set_key_limits(db, 2**40, rpm=1, tpm=None, budget_usd=None)


def test_the_cli_takes_metacharacters_as_plain_text(db_url, capsys):
    base = ["--database-url", db_url]
    for name in ("abc", "a%", DROP):
        assert main([*base, "tenants", "create", name]) == 0
        assert main([*base, "keys", "create", "--tenant", name, "--project", name]) == 0
    capsys.readouterr()
    assert main([*base, "keys", "list", "--tenant", "a%", "--json"]) == 0
    assert [(k["tenant"], k["project"]) for k in json.loads(capsys.readouterr().out)] == [("a%", "a%")]
    assert main([*base, "usage", "--tenant", "a%", "--user", "%", "--tag", "_", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main([*base, "usage", "--tenant", "a\x00"]) == 2
    assert "tenant: must not contain NUL" in capsys.readouterr().err
    assert main([*base, "tenants", "list", "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)] == ["abc", "a%", DROP]
