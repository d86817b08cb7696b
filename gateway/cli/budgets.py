"""`platform budgets set | list | delete`: monthly budgets within a tenant for one end user (the requests' `user`
field) or one tag (a key's project or a request's metadata.tags), reserved at admission like key and tenant budgets."""

from __future__ import annotations

import argparse
from typing import Any

from billing.migrate import open_database
from billing.money import usd
from gateway.cli.output import print_rows
from gateway.settings import Settings


def register(sub: Any) -> None:
    budgets = sub.add_parser("budgets", help="budgets for an end user or a tag within a tenant")
    actions = budgets.add_subparsers(required=True, metavar="ACTION")
    put = actions.add_parser("set", help="create or replace the monthly budget of an end user or a tag")
    _whose(put)
    put.add_argument("--budget-usd", type=float, required=True, help="monthly budget in USD (> 0)")
    put.add_argument("--alert-at", type=float, help="soft budget: alert once a month at this share of the budget "
                                                    "(0.8: at 80%%; TOLLGATE_BUDGET_ALERT_WEBHOOK gets a POST)")
    put.set_defaults(func=cmd_set)
    listed = actions.add_parser("list", help="budgets with their spend and reservations this month")
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
    from billing.scoped_budgets import set_budget

    use = set_budget(open_database(settings.db_url), args.tenant, user=args.user, tag=args.tag,
                     budget_usd=args.budget_usd, alert_at=args.alert_at)
    alert = f", alert at {use.alert_at:g}" if use.alert_at is not None else ""
    print(f"budget of {_subject(use.scope, use.name, use.tenant)}: {usd(use.budget_usd)} a month{alert}; "
          f"{usd(use.spent_usd)} spent and {usd(use.reserved_usd)} reserved in {use.period}")
    return 0


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    from billing.scoped_budgets import list_budgets

    rows = [{"tenant": u.tenant, "scope": u.scope, "name": u.name, "budget_usd": u.budget_usd, "alert_at": u.alert_at,
             "month": u.period, "spent_usd": u.spent_usd, "reserved_usd": u.reserved_usd, "left_usd": u.left_usd}
            for u in list_budgets(open_database(settings.db_url), args.tenant)]
    print_rows(rows, args.json)
    return 0


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    from billing.scoped_budgets import delete_budget

    delete_budget(open_database(settings.db_url), args.tenant, user=args.user, tag=args.tag)
    scope, name = ("user", args.user) if args.user is not None else ("tag", args.tag)
    print(f"deleted the budget of {_subject(scope, name, args.tenant)}")
    return 0
