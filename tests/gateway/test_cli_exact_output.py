"""What the `platform` command prints for money and names: exact decimal text (never a float) in tables, --json
and report files; end users and tags kept per tenant and as the strings they are ("NaN" stays "NaN"); every
budget in `budgets list`; and a quiet exit when the reader of its output goes away."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.models import ModelDeployment, Tenant, UsageEvent
from gateway.cli import main

MARCH = datetime(2026, 3, 10, tzinfo=timezone.utc)


def _platform(capsys, db_url: str, line: str) -> tuple[int, str, str]:
    code = main(["--database-url", db_url, *shlex.split(line)[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def _event(n: int, tenant_id: int, user: str | None, cost: str, tags: list[str] | None = None, prompt: int = 0,
           key_id: int | None = None) -> UsageEvent:
    return UsageEvent(request_id=f"r{n}", tenant_id=tenant_id, api_key_id=key_id, end_user=user, tags=tags or [],
                      model="small", endpoint="chat.completions", status="ok", prompt_tokens=prompt,
                      completion_tokens=0, cost_usd=Decimal(cost), created_at=MARCH)


def test_report_csv_and_json_carry_money_as_exact_decimal_text(db, db_url, capsys):
    create_tenant(db, "acme")
    with Session(db) as s, s.begin():
        s.add(ModelDeployment(name="small", spec={}, input_per_1m=Decimal("0.1"), output_per_1m=0))
        # 3M tokens at $0.1 per 1M: $0.3 (a float product gives 0.30000000000000004)
        s.add(_event(1, s.query(Tenant).one().id, None, "0.3", prompt=3_000_000))
    code, out, _ = _platform(capsys, db_url, "platform report --format csv --since 2026-03-01 --until 2026-04-01")
    [row] = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and (row["revenue_usd"], row["margin_usd"], row["gpu_cost_usd"]) == ("0.30", "0.30", "0.00")
    code, out, _ = _platform(capsys, db_url, "platform report --format json --since 2026-03-01")
    [row] = json.loads(out)
    assert code == 0 and (row["revenue_usd"], row["margin_usd"]) == ("0.30", "0.30")


def test_json_outputs_carry_money_as_exact_decimal_text(db, db_url, capsys):
    acme = create_tenant(db, "acme", budget_usd=Decimal("0.005"))
    key = create_key(db, "acme", budget_usd=Decimal("5"))
    with Session(db) as s, s.begin():
        s.add_all([_event(i, acme.id, "alice", "0.1", key_id=key.id) for i in range(3)])
    usage = json.loads(_platform(capsys, db_url, "platform usage --group-by tenant --json")[1])
    assert usage == [{"tenant": "acme", "requests": 3, "prompt_tokens": 0, "completion_tokens": 0,
                      "cached_tokens": 0, "cost_usd": "0.30"}]
    [listed] = json.loads(_platform(capsys, db_url, "platform keys list --json")[1])
    assert listed["budget_usd"] == "5.00"
    [tenant] = json.loads(_platform(capsys, db_url, "platform tenants list --json")[1])
    assert tenant["budget_usd"] == "0.005"  # a budget under a cent keeps its precision
    table = _platform(capsys, db_url, "platform usage --group-by tenant")[1]
    assert table.splitlines()[1].split() == ["acme", "3", "0", "0", "0", "0.30"]


def test_budgets_list_shows_tenant_and_key_budgets_beside_user_and_tag_ones(db, db_url, capsys):
    create_tenant(db, "acme", budget_usd=Decimal("20"), alert_at=0.8)
    key = create_key(db, "acme", budget_usd=Decimal("0.005"), name="ci")
    create_key(db, "acme", budget_usd=Decimal("9"), name="gone")
    assert _platform(capsys, db_url, "platform keys revoke " + str(key.id + 1))[0] == 0
    assert _platform(capsys, db_url, "platform budgets set --tenant acme --user alice --budget-usd 5")[0] == 0
    create_tenant(db, "beta")
    create_key(db, "beta", budget_usd=Decimal("1"))
    with Session(db) as s, s.begin():
        s.add(_event(1, 1, "alice", "0.001", key_id=key.id))
    # usage events written directly count toward the counters only through the ledger: the counters are empty here
    code, out, _ = _platform(capsys, db_url, "platform budgets list --tenant acme --json")
    rows = json.loads(out)
    assert code == 0 and [(r["scope"], r["name"]) for r in rows] == [
        ("tenant", "acme"), ("key", key.prefix + "... (ci)"), ("user", "alice")]
    tenant, key_row, _ = rows
    assert (tenant["budget_usd"], tenant["alert_at"], tenant["spent_usd"], tenant["reserved_usd"],
            tenant["left_usd"]) == ("20.00", 0.8, "0.00", "0.00", "20.00")
    assert (key_row["budget_usd"], key_row["left_usd"]) == ("0.005", "0.005")
    code, out, _ = _platform(capsys, db_url, "platform budgets list")
    header, *lines = out.splitlines()
    assert header.split() == ["tenant", "scope", "name", "budget_usd", "alert_at", "month", "spent_usd",
                              "reserved_usd", "left_usd"]
    assert [line.split()[:2] for line in lines] == [["acme", "tenant"], ["acme", "key"], ["acme", "user"],
                                                    ["beta", "key"]]


def test_usage_by_user_or_tag_keeps_tenants_apart_and_names_as_strings(db, db_url, capsys):
    acme, beta = create_tenant(db, "acme"), create_tenant(db, "beta")
    users = [(acme.id, "alice"), (beta.id, "alice"), (acme.id, "NaN"), (acme.id, "nan"), (acme.id, None),
             (acme.id, "1e3"), (acme.id, "null")]
    with Session(db) as s, s.begin():
        s.add_all([_event(i, t, u, "0.1", tags=[u or "untagged"]) for i, (t, u) in enumerate(users)])
    code, out, _ = _platform(capsys, db_url, "platform usage --group-by user --json")
    got = {(r["tenant"], r["user"]): r["requests"] for r in json.loads(out)}
    assert code == 0 and got == {("acme", "alice"): 1, ("beta", "alice"): 1, ("acme", "NaN"): 1, ("acme", "nan"): 1,
                                 ("acme", None): 1, ("acme", "1e3"): 1, ("acme", "null"): 1}
    table = _platform(capsys, db_url, "platform usage --group-by user")[1].splitlines()
    cells = sorted(tuple(line.split()[:3]) for line in table[1:])
    assert table[0].split()[:2] == ["tenant", "user"]
    assert cells == sorted([("acme", "alice", "1"), ("beta", "alice", "1"), ("acme", "NaN", "1"),
                            ("acme", "nan", "1"), ("acme", "(none)", "1"), ("acme", "1e3", "1"), ("acme", "null", "1")])
    tags = {(r["tenant"], r["tag"]): r["requests"] for r in
            json.loads(_platform(capsys, db_url, "platform usage --group-by tag --json")[1])}
    assert tags[("acme", "alice")] == tags[("beta", "alice")] == 1 and tags[("acme", "NaN")] == 1


def test_a_reader_that_goes_away_ends_the_command_quietly(db, db_url):
    create_tenant(db, "acme")
    env = {**os.environ, "TOLLGATE_DATABASE_URL": db_url}
    for args in (["keys", "list"], ["settings"], ["usage", "--json"]):
        child = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        child.stdout.close()  # no reader left: its first write to stdout is a broken pipe, as under `| head -0`
        err = child.stderr.read().decode()
        assert child.wait(60) == 141, err
        assert err == ""


def test_keys_list_shows_each_keys_alert_at(db, db_url, capsys):
    create_tenant(db, "acme")
    create_key(db, "acme", budget_usd=Decimal("5"), alert_at=0.8, name="soft")
    create_key(db, "acme", name="plain")
    soft, plain = json.loads(_platform(capsys, db_url, "platform keys list --json")[1])
    assert (soft["alert_at"], plain["alert_at"]) == (0.8, None)
    header, *rows = _platform(capsys, db_url, "platform keys list")[1].splitlines()
    column = header.split().index("alert_at")
    assert [r.split()[column] for r in rows] == ["0.8", "(none)"]


def test_usage_by_user_shows_an_empty_user_as_quotes_and_a_missing_one_as_none(db, db_url, capsys):
    acme = create_tenant(db, "acme")
    with Session(db) as s, s.begin():
        s.add_all([_event(1, acme.id, "", "0.1"), _event(2, acme.id, None, "0.2")])
    rows = json.loads(_platform(capsys, db_url, "platform usage --group-by user --json")[1])
    assert sorted((r["user"] is None, r["user"], r["cost_usd"]) for r in rows) == [
        (False, "", "0.10"), (True, None, "0.20")]
    table = _platform(capsys, db_url, "platform usage --group-by user")[1].splitlines()
    assert sorted(line.split()[1:3] for line in table[1:]) == [['""', "1"], ["(none)", "1"]]
