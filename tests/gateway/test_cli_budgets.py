"""`platform budgets set | list | delete`, run through the command's own entry point (gateway.cli.main) with the
README's command lines, against a real database: what it prints, what it stores, and what it refuses."""

from __future__ import annotations

import json
import shlex
from decimal import Decimal

import pytest

from billing.accounts import create_key
from billing.ledger import Ledger
from billing.models import UsageEvent
from billing.reservations import Worst
from gateway.auth import KeyStore
from gateway.cli import main
from gateway.limits import Limiter


def _platform(capsys, db_url: str, line: str) -> tuple[int, str, str]:
    code = main(["--database-url", db_url, *shlex.split(line)[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_budgets_set_list_delete_round_trip(db, db_url, capsys) -> None:
    assert _platform(capsys, db_url, "platform tenants create acme")[0] == 0
    code, out, _ = _platform(capsys, db_url, "platform budgets set --tenant acme --user alice --budget-usd 5 "
                                             "--alert-at 0.8")
    assert code == 0 and out.startswith("budget of end user 'alice' of tenant 'acme': $5.00 a month, alert at 0.8;")
    assert _platform(capsys, db_url, "platform budgets set --tenant acme --tag search --budget-usd 50")[0] == 0
    key = create_key(db, "acme")
    p = KeyStore(db).authenticate(f"Bearer {key.key}")
    Limiter(db).admit(p, "held", Worst(Decimal("0.5"), 0), model="m", endpoint="chat.completions", end_user="alice",
                      tags=["search"])
    ledger = Ledger(db).start()
    ledger.record(UsageEvent(request_id="done", tenant_id=p.tenant_id, api_key_id=p.key_id, end_user="alice",
                             tags=["search"], model="m", endpoint="chat.completions", status="ok", cost_usd=0.25))
    ledger.close()

    code, out, _ = _platform(capsys, db_url, "platform budgets list --tenant acme --json")
    rows = {(r["scope"], r["name"]): r for r in json.loads(out)}
    assert code == 0 and set(rows) == {("user", "alice"), ("tag", "search")}
    alice, search = rows[("user", "alice")], rows[("tag", "search")]
    assert (alice["budget_usd"], alice["alert_at"], alice["spent_usd"], alice["reserved_usd"], alice["left_usd"]) == (
        "5.00", 0.8, "0.25", "0.50", "4.25")  # money as exact decimal text
    assert (search["budget_usd"], search["spent_usd"], search["reserved_usd"], search["left_usd"]) == (
        "50.00", "0.25", "0.50", "49.25")
    code, out, _ = _platform(capsys, db_url, "platform budgets list")
    header, *lines = out.splitlines()
    assert header.split() == ["tenant", "scope", "name", "budget_usd", "alert_at", "month", "spent_usd",
                              "reserved_usd", "left_usd"]
    assert [line.split()[:4] for line in lines] == [["acme", "user", "alice", "5.00"], ["acme", "tag", "search", "50.00"]]

    # set again: a new budget, the same spend; the alert share not given is kept
    code, out, _ = _platform(capsys, db_url, "platform budgets set --tenant acme --user alice --budget-usd 7.5")
    assert code == 0 and out.strip() == ("budget of end user 'alice' of tenant 'acme': $7.50 a month, alert at 0.8; "
                                         "$0.25 spent and $0.50 reserved in " + alice["month"])
    code, out, _ = _platform(capsys, db_url, "platform budgets delete --tenant acme --user alice")
    assert code == 0 and out.strip() == "deleted the budget of end user 'alice' of tenant 'acme'"
    assert [r["name"] for r in json.loads(_platform(capsys, db_url, "platform budgets list --json")[1])] == ["search"]
    assert _platform(capsys, db_url, "platform budgets delete --tenant acme --tag search")[0] == 0
    assert _platform(capsys, db_url, "platform budgets list --tenant acme")[1].strip() == "none"


@pytest.mark.parametrize(("line", "error"), [
    ("platform budgets set --tenant acme --user alice --budget-usd 0", "budget_usd: must be > 0, got 0"),
    ("platform budgets set --tenant acme --tag search --budget-usd -5", "budget_usd: must be > 0, got -5"),
    ("platform budgets set --tenant acme --user alice --budget-usd inf", "budget_usd: must be a finite amount"),
    ("platform budgets set --tenant acme --user alice --budget-usd 5 --alert-at 1.5", "alert_at: must be a share"),
    ("platform budgets set --tenant nope --user alice --budget-usd 5", "tenant: no tenant named 'nope'"),
    ("platform budgets set --tenant acme --user '' --budget-usd 5", "user: must not be empty"),
    ("platform budgets delete --tenant acme --user bob", "user: tenant 'acme' has no budget for end user 'bob'"),
    ("platform budgets delete --tenant nope --tag search", "tenant: no tenant named 'nope'"),
    ("platform budgets list --tenant nope", "tenant: no tenant named 'nope'"),
])
def test_budgets_refuse_bad_values_naming_the_field(db, db_url, capsys, line: str, error: str) -> None:
    _platform(capsys, db_url, "platform tenants create acme")
    code, _, err = _platform(capsys, db_url, line)
    assert code == 2 and err.startswith(f"error: {error}"), err
    assert json.loads(_platform(capsys, db_url, "platform budgets list --json")[1]) == []  # nothing was stored


@pytest.mark.parametrize("line", [
    "platform budgets set --tenant acme --budget-usd 5",  # neither --user nor --tag
    "platform budgets set --tenant acme --user alice --tag search --budget-usd 5",  # both
    "platform budgets set --tenant acme --user alice",  # no --budget-usd
])
def test_budgets_set_needs_one_end_user_or_tag_and_an_amount(db_url, capsys, line: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--database-url", db_url, *shlex.split(line)[1:]])
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err


def test_money_arguments_are_exact_decimals_and_finer_than_a_nano_dollar_is_refused(db, db_url, capsys) -> None:
    _platform(capsys, db_url, "platform tenants create gamma")
    code, out, _ = _platform(capsys, db_url, "platform budgets set --tenant gamma --user dave --budget-usd 12345678.123456789")
    assert code == 0 and "$12,345,678.123456789 a month" in out
    [row] = json.loads(_platform(capsys, db_url, "platform budgets list --tenant gamma --json")[1])
    assert row["budget_usd"] == "12345678.123456789"
    with pytest.raises(SystemExit):
        _platform(capsys, db_url, "platform budgets set --tenant gamma --user dave --budget-usd 0.0000000001")
    assert "more decimals than the ledger keeps" in capsys.readouterr().err
    code, _, err = _platform(capsys, db_url, "platform budgets set --tenant gamma --user dave --budget-usd -1")
    assert code == 2 and err.startswith("error: budget_usd: must be > 0, got -1\n"), err
    with pytest.raises(SystemExit):
        _platform(capsys, db_url, "platform keys create --tenant gamma --budget-usd 0.1234567891")
    assert "at most 9 decimals" in capsys.readouterr().err


def test_setting_a_budget_again_keeps_its_alert_unless_told_to_clear_it(db, db_url, capsys) -> None:
    _platform(capsys, db_url, "platform tenants create delta")
    _platform(capsys, db_url, "platform budgets set --tenant delta --tag search --budget-usd 5 --alert-at 0.8")
    code, out, _ = _platform(capsys, db_url, "platform budgets set --tenant delta --tag search --budget-usd 10")
    assert code == 0 and "alert at 0.8" in out
    [row] = json.loads(_platform(capsys, db_url, "platform budgets list --tenant delta --json")[1])
    assert (row["budget_usd"], row["alert_at"]) == ("10.00", 0.8)
    _platform(capsys, db_url, "platform budgets set --tenant delta --tag search --budget-usd 10 --alert-at none")
    [row] = json.loads(_platform(capsys, db_url, "platform budgets list --tenant delta --json")[1])
    assert row["alert_at"] is None
