"""`platform admin create-key`: register(subparsers, load_settings) adds it to the `platform`
command's argparse subparsers, as gateway/cli_reports.py does. The key is printed once; only its
SHA-256 hash is stored."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from gateway.settings import Settings

LoadSettings = Callable[[argparse.Namespace], Settings]


def register(subparsers: Any, load_settings: LoadSettings) -> None:
    def bind(handler: Callable[[argparse.Namespace, Settings], int]) -> Callable[..., int]:
        def run(args: argparse.Namespace, settings: Settings | None = None) -> int:
            return handler(args, settings if settings is not None else load_settings(args))
        return run

    admin = subparsers.add_parser("admin", help="operators' keys for the admin dashboard (/admin)")
    actions = admin.add_subparsers(required=True, metavar="ACTION")
    create = actions.add_parser("create-key", help="create an admin key (printed once)")
    create.add_argument("--name", help="a label shown in listings")
    create.set_defaults(func=bind(cmd_create_key))


def cmd_create_key(args: argparse.Namespace, settings: Settings) -> int:
    from billing.admin_keys import create_admin_key
    from billing.db import make_engine
    from billing.migrate import upgrade

    upgrade(settings.db_url)
    engine = make_engine(settings.db_url)
    try:
        created = create_admin_key(engine, args.name)
    finally:
        engine.dispose()
    print(created.key, flush=True)  # alone on stdout, so scripts can capture it
    print(f"admin key {created.prefix}… (id {created.id}) created; it is shown only this once. "
          "Sign in at /admin with it.", file=sys.stderr)
    return 0
