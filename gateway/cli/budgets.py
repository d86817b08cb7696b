"""`platform budgets set | list | delete`: monthly budgets within a tenant for one end user (the requests' `user`
field) or one tag (a key's project or a request's metadata.tags), reserved at admission like key and tenant budgets.
`list` shows every budget, the tenants' and keys' too (set with `tenants create` / `keys create --budget-usd`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from billing.migrate import open_database
from billing.money import usd
from gateway.cli.args import NO_ALERT, alert_arg, money_arg
from gateway.cli.output import print_rows
from gateway.settings import Settings


def register(sub: Any) -> None:
    budgets = sub.add_parser("budgets", help="budgets for an end user or a tag within a tenant; list shows all budgets")
    actions = budgets.add_subparsers(required=True, metavar="ACTION")
    put = actions.add_parser("set", help="create or replace the monthly budget of an end user or a tag")
    _whose(put)
    put.add_argument("--budget-usd", type=money_arg, required=True, help="monthly budget in USD (> 0)")
    put.add_argument("--alert-at", type=alert_arg, help="soft budget: alert once a month at this share of the budget "
                                                    "(0.8: at 80%%; TOLLGATE_BUDGET_ALERT_WEBHOOK gets a POST); `none` "
                                                    "clears it; left out, an existing budget keeps its alert")
    put.set_defaults(func=cmd_set)
    listed = actions.add_parser("list", help="every budget (tenant, key, end user, tag) with its spend and "
                                             "reservations this month")
    listed.add_argument("--tenant")
    listed.add_argument("--json", action="store_true")
    listed.set_defaults(func=cmd_list)
    gone = actions.add_parser("delete", help="remove the budget of an end user or a tag")
    _whose(gone)
    gone.set_defaults(func=cmd_delete)


def _whose(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", required=True)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="an end user: the `user` field of the tenant's requests")
    who.add_argument("--tag", help="a tag: a key's --project or a request's metadata.tags")


def _subject(scope: str, name: str, tenant: str) -> str:
    from billing.scoped_budgets import SCOPE_WORDS

    return f"{SCOPE_WORDS[scope]} {name!r} of tenant {tenant!r}"


def cmd_set(args: argparse.Namespace, settings: Settings) -> int:
    from billing.scoped_budgets import list_budgets, set_budget

    db = open_database(settings.db_url)
    alert_at = None if args.alert_at == NO_ALERT else args.alert_at
    if args.alert_at is None:  # not given: the budget keeps the alert it has
        scope, name = ("user", args.user) if args.user is not None else ("tag", args.tag)
        alert_at = next((u.alert_at for u in list_budgets(db, args.tenant) if (u.scope, u.name) == (scope, name)), None)
    use = set_budget(db, args.tenant, user=args.user, tag=args.tag, budget_usd=args.budget_usd, alert_at=alert_at)
    alert = f", alert at {use.alert_at:g}" if use.alert_at is not None else ""
    print(f"budget of {_subject(use.scope, use.name, use.tenant)}: {usd(use.budget_usd)} a month{alert}; "
          f"{usd(use.spent_usd)} spent and {usd(use.reserved_usd)} reserved in {use.period}")
    return 0


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    """Every budget: the tenants', the keys' (not revoked), and the tenants' end-user and tag budgets."""
    from billing.budget_use import SCOPE_ORDER, budget_lines
    from billing.periods import month_of
    from billing.scoped_budgets import list_budgets

    db = open_database(settings.db_url)
    if args.tenant is not None:
        list_budgets(db, args.tenant)  # refuses an unknown tenant, naming the field
    month = month_of(time.time())
    lines = [b for b in budget_lines(db, month) if args.tenant is None or b.tenant == args.tenant]
    lines.sort(key=lambda b: (b.tenant, SCOPE_ORDER.index(b.scope), b.name or b.key_prefix or ""))
    rows = [{"tenant": b.tenant, "scope": b.scope, "name": _name(b), "budget_usd": b.budget_usd, "alert_at": b.alert_at,
             "month": month, "spent_usd": b.spent_usd, "reserved_usd": b.reserved_usd, "left_usd": b.left_usd}
            for b in lines]
    print_rows(rows, args.json)
    return 0


def _name(b: Any) -> str:
    """Whose budget: the tenant's name, a key's display prefix (and its name), an end user's or a tag's name."""
    if b.scope == "tenant":
        return b.tenant
    if b.scope == "key":
        return f"{b.key_prefix}..." + (f" ({b.key_name})" if b.key_name else "")
    return b.name


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    from billing.scoped_budgets import delete_budget

    delete_budget(open_database(settings.db_url), args.tenant, user=args.user, tag=args.tag)
    scope, name = ("user", args.user) if args.user is not None else ("tag", args.tag)
    print(f"deleted the budget of {_subject(scope, name, args.tenant)}")
    return 0
