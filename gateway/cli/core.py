"""`platform db`, `tenants`, `keys`, `usage`, `cache eval` and `settings`: the commands that need only
the database (or nothing)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from billing.migrate import open_database
from gateway.cli.args import UNTIL_HELP, date_arg, money_arg
from gateway.cli.output import print_frame, print_rows
from gateway.settings import Settings
from tollgate import envs


def register(sub: Any) -> None:
    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="apply migrations").set_defaults(func=cmd_db_upgrade)

    tenants = sub.add_parser("tenants", help="tenants")
    t_sub = tenants.add_subparsers(required=True, metavar="ACTION")
    tc = t_sub.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--budget-usd", type=money_arg, help="monthly budget in USD")
    tc.add_argument("--alert-at", type=float, help="soft budget: alert once a month at this share of the budget "
                                                   "(0.8: at 80%%; TOLLGATE_BUDGET_ALERT_WEBHOOK gets a POST)")
    _cache_bound_arg(tc, "the semantic cache's bound for the tenant's keys")
    tc.set_defaults(func=cmd_tenants_create)
    tl = t_sub.add_parser("list", help="list tenants")
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(func=cmd_tenants_list)

    keys = sub.add_parser("keys", help="API keys")
    k_sub = keys.add_subparsers(required=True, metavar="ACTION")
    kc = k_sub.add_parser("create", help="create a key (printed once)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--rpm", type=int)
    kc.add_argument("--tpm", type=int)
    kc.add_argument("--budget-usd", type=money_arg, help="monthly budget in USD")
    kc.add_argument("--alert-at", type=float, help="soft budget: alert once a month at this share of the budget")
    kc.add_argument("--name")
    kc.add_argument("--project", help="a tag put on every usage event of this key")
    _cache_bound_arg(kc, "the semantic cache's bound for this key (default: its tenant's)")
    kc.set_defaults(func=cmd_keys_create)
    kl = k_sub.add_parser("list", help="list keys (prefixes only)")
    kl.add_argument("--tenant")
    kl.add_argument("--json", action="store_true")
    kl.set_defaults(func=cmd_keys_list)
    kr = k_sub.add_parser("revoke", help="revoke a key by id or display prefix")
    kr.add_argument("key")
    kr.set_defaults(func=cmd_keys_revoke)

    usage = sub.add_parser("usage", help="usage and cost")
    usage.add_argument("--tenant")
    usage.add_argument("--since", type=date_arg, help="YYYY-MM-DD (inclusive, UTC)")
    usage.add_argument("--until", type=date_arg, help=UNTIL_HELP)
    usage.add_argument("--user", help="only this end user (the requests' `user` field)")
    usage.add_argument("--tag", help="only events carrying this tag (a key's project or a request's metadata.tags)")
    usage.add_argument("--group-by", default="day,model",
                       help="comma list of day,month,model,tenant,key,user,tag,status,endpoint (model as asked: "
                            "model:adapter for a LoRA adapter's requests)")
    usage.add_argument("--gpu", action="store_true", help="replica time per model and day: alive, busy, idle rate")
    usage.add_argument("--model", help="with --gpu: only this model")
    usage.add_argument("--by", choices=("model", "tenant"), default="model",
                       help="with --gpu: per model (alive, busy, idle rate) or per tenant (each one's busy and idle "
                            "share of the replicas' time)")
    usage.add_argument("--json", action="store_true")
    usage.set_defaults(func=cmd_usage)

    cache = sub.add_parser("cache", help="semantic cache")
    c_sub = cache.add_subparsers(required=True, metavar="ACTION")
    ce = c_sub.add_parser("eval", help="hit and false-hit rates of the shipped cache on {a, b, duplicate} pairs "
                                       "at a false-hit bound")
    from cache.eval import add_arguments

    add_arguments(ce)
    ce.set_defaults(func=cmd_cache_eval)
    cs = c_sub.add_parser("set", help="set a tenant's (or one key's) false-hit bound δ")
    cs.add_argument("--tenant", required=True)
    cs.add_argument("--key", help="one of the tenant's keys (id or display prefix); without it, the tenant")
    bound = cs.add_mutually_exclusive_group(required=True)
    _cache_bound_arg(bound, "the most a share of different questions may be served a cached answer")
    bound.add_argument("--default", action="store_true", help="clear it: a key follows its tenant, a tenant the "
                                                               "platform's default")
    cs.set_defaults(func=cmd_cache_set)

    st = sub.add_parser("settings", help="every TOLLGATE_* variable: type, default, the value in effect, help")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_settings)


def cmd_settings(args: argparse.Namespace, _: Settings) -> int:
    rows = envs.table()
    if args.json:
        print_rows(rows, True)
        return 0
    # unset shows as the table's missing mark, not as an empty string
    shown = [{"variable": r["name"], "type": r["type"], "default": r["default"], "value": r["value"],
              "set": "yes" if r["set"] else "no", "help": r["help"]} for r in rows]
    print_rows(shown, False)
    return 0


def _cache_bound_arg(parser: Any, what: str) -> None:
    from tollgate.false_hit_bounds import DEFAULT, OFFERED

    parser.add_argument("--cache-max-false-hit-rate", type=float, choices=OFFERED, metavar="D",
                        help=f"{what}: one of {', '.join(f'{d:g}' for d in OFFERED)} (0.01: at most 1%% of different "
                             f"questions served a cached answer; the platform's default is {DEFAULT:g})")


def cmd_cache_set(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import set_cache_bound

    value = None if args.default else args.cache_max_false_hit_rate
    set_cache_bound(open_database(settings.db_url), args.tenant, value, key=args.key)
    whose = f"key {args.key} of tenant {args.tenant}" if args.key else f"tenant {args.tenant}"
    print(f"cache false-hit bound of {whose}: {'default' if value is None else f'{value:g}'}")
    return 0


def cmd_cache_eval(args: argparse.Namespace, _: Settings) -> int:
    from cache import eval as cache_eval

    return cache_eval.main(["--pairs", str(args.pairs), "--max-false-hit-rate", str(args.max_false_hit_rate)]
                           + (["--json"] if args.json else []))


def cmd_db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    open_database(settings.db_url).dispose()
    print("database is at the latest revision")
    return 0


def cmd_tenants_create(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import create_tenant

    tenant = create_tenant(open_database(settings.db_url), args.name, args.budget_usd, args.alert_at,
                           args.cache_max_false_hit_rate)
    print(f"created tenant {tenant.name} (id {tenant.id})")
    return 0


def cmd_tenants_list(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import list_tenants

    rows = [{"id": t.id, "name": t.name, "budget_usd": t.budget_usd, "alert_at": t.alert_at,
             "cache_max_false_hit_rate": t.cache_max_false_hit_rate, "created_at": t.created_at.isoformat()}
            for t in list_tenants(open_database(settings.db_url))]
    print_rows(rows, args.json)
    return 0


def cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import create_key

    created = create_key(open_database(settings.db_url), args.tenant, rpm=args.rpm, tpm=args.tpm,
                         budget_usd=args.budget_usd, name=args.name, project=args.project, alert_at=args.alert_at,
                         cache_max_false_hit_rate=args.cache_max_false_hit_rate)
    print(created.key)
    print(f"key id {created.id} for tenant {created.tenant}; it is shown only once", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import list_keys

    rows = [{"id": k.id, "prefix": k.prefix + "...", "tenant": k.tenant, "name": k.name, "project": k.project,
             "rpm": k.rpm, "tpm": k.tpm, "budget_usd": k.budget_usd, "alert_at": k.alert_at,
             "cache_max_false_hit_rate": k.cache_max_false_hit_rate, "revoked": k.revoked,
             "created_at": k.created_at.isoformat()} for k in list_keys(open_database(settings.db_url), args.tenant)]
    print_rows(rows, args.json)
    return 0


def cmd_keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import revoke_key

    key_id = revoke_key(open_database(settings.db_url), args.key)
    print(f"revoked key {key_id}")
    return 0


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    if not args.gpu and (args.by != "model" or args.model is not None):
        raise ValueError(f"{'--by' if args.by != 'model' else '--model'}: only with --gpu (usage rows group with "
                         "--group-by and filter with --tenant, --user, --tag)")
    db = open_database(settings.db_url)
    if args.gpu:
        from billing.gpu_usage import gpu_usage_by_tenant, gpu_usage_frame

        per = gpu_usage_by_tenant if args.by == "tenant" else gpu_usage_frame
        frame = per(db, model=args.model, since=args.since, until=args.until)
        print_frame(frame, args.json, "no replica time recorded")
        return 0
    from billing.usage import usage_frame

    groups = tuple(g.strip() for g in args.group_by.split(",") if g.strip())
    frame = usage_frame(db, tenant=args.tenant, since=args.since, until=args.until, group_by=groups,
                        user=args.user, tag=args.tag)
    print_frame(frame, args.json, "no usage")
    return 0
