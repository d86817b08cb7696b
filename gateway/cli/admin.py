"""`platform admin create-key`. The key is printed once; only its SHA-256 hash is stored."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gateway.settings import Settings


def register(subparsers: Any) -> None:
    admin = subparsers.add_parser("admin", help="operators' keys for the admin dashboard (/admin)")
    actions = admin.add_subparsers(required=True, metavar="ACTION")
    create = actions.add_parser("create-key", help="create an admin key (printed once)")
    create.add_argument("--name", help="a label shown in listings")
    create.set_defaults(func=cmd_create_key)


def cmd_create_key(args: argparse.Namespace, settings: Settings) -> int:
    from billing.admin_keys import create_admin_key
    from billing.migrate import open_database

    engine = open_database(settings.db_url)
    try:
        created = create_admin_key(engine, args.name)
    finally:
        engine.dispose()
    print(created.key, flush=True)  # alone on stdout, so scripts can capture it
    print(f"admin key {created.prefix}… (id {created.id}) created; it is shown only this once. "
          "Sign in at /admin with it.", file=sys.stderr)
    return 0
