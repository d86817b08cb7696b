"""`platform adapters add|list|remove`: LoRA adapters of a running gateway's models, changed without restarting them
(gateway/adapter_routes.py), through its admin API with the admin key (--admin-key or TOLLGATE_ADMIN_KEY)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from gateway.cli.args import money_arg
from gateway.cli.output import print_rows
from gateway.settings import Settings


def register(sub: Any) -> None:
    adapters = sub.add_parser("adapters", help="LoRA adapters served over a running gateway's models")
    actions = adapters.add_subparsers(required=True, metavar="ACTION")
    add = actions.add_parser("add", help="serve a PEFT adapter directory as MODEL:NAME")
    add.add_argument("model", help="the base model (a chat model of the running gateway)")
    add.add_argument("name", help="the adapter's name: clients ask for model MODEL:NAME")
    add.add_argument("source", help="a directory written by peft's save_pretrained")
    add.add_argument("--tenant", action="append", dest="tenants", help="a tenant that may use it (repeatable; "
                     "default: every tenant)")
    add.add_argument("--input-per-1m", type=money_arg, help="its input price (default: the model's)")
    add.add_argument("--output-per-1m", type=money_arg, help="its output price (default: the model's)")
    add.set_defaults(func=cmd_add)
    ls = actions.add_parser("list", help="the adapters served now")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    rm = actions.add_parser("remove", help="stop serving an adapter (running requests finish with it)")
    rm.add_argument("model")
    rm.add_argument("name")
    rm.set_defaults(func=cmd_remove)
    for p in (add, ls, rm):
        p.add_argument("--url", help="the gateway (default http://$TOLLGATE_HOST:$TOLLGATE_PORT)")
        p.add_argument("--admin-key", help="default $TOLLGATE_ADMIN_KEY")


def _call(args: argparse.Namespace, settings: Settings, method: str, path: str, body: Any = None) -> Any:
    import httpx

    key = args.admin_key or (settings.admin_key.get_secret_value() if settings.admin_key else None)
    if not key:
        raise ValueError("admin key: pass --admin-key or set TOLLGATE_ADMIN_KEY")
    url = (args.url or f"http://{settings.host}:{settings.port}").rstrip("/")
    try:
        response = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                                 timeout=600)
    except httpx.HTTPError as e:
        raise ValueError(f"url: cannot reach the gateway at {url} ({e})") from None
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ValueError(message)
    return response.json()


def cmd_add(args: argparse.Namespace, settings: Settings) -> int:
    body: dict[str, Any] = {"model": args.model, "name": args.name, "source": os.path.abspath(args.source)}
    if args.tenants:
        body["tenants"] = args.tenants
    if args.input_per_1m is not None or args.output_per_1m is not None:
        body["pricing"] = {"input_per_1m": str(args.input_per_1m or 0), "output_per_1m": str(args.output_per_1m or 0)}
    row = _call(args, settings, "POST", "/admin/adapters", body)
    print(f"serving {row['id']} from {row['source']}")
    return 0


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = _call(args, settings, "GET", "/admin/adapters")["data"]
    for row in rows:
        row["tenants"] = ",".join(row["tenants"]) if row["tenants"] else "all"
        for price in ("input_per_1m", "output_per_1m"):
            row[price] = row[price] if row[price] is not None else "base model's"
    print_rows(rows, args.json)
    return 0


def cmd_remove(args: argparse.Namespace, settings: Settings) -> int:
    _call(args, settings, "DELETE", f"/admin/adapters/{args.model}/{args.name}")
    print(f"removed {args.model}:{args.name}")
    return 0
