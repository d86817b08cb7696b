"""The `platform` command. Its subcommands live beside this file: core.py (database, tenants, keys,
usage, cache, settings), budgets.py (end-user and tag budgets), serve.py (the gateway and the Ray Serve
platform), admin.py and reports.py.
Each module's `register(subparsers)` adds its commands; each command runs as func(args, settings)."""

from __future__ import annotations

import argparse
import os
import sys

from gateway.cli import adapters, admin, budgets, core, reports, serve
from gateway.serving.errors import NoPlatform
from gateway.settings import Settings

EXIT_USAGE = 2
EXIT_NO_PLATFORM = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="platform", description="Tollgate: serverless LLM inference "
                                "(`platform settings` lists every TOLLGATE_* variable and its value)")
    p.add_argument("--home", help="state directory (default $TOLLGATE_HOME or ~/.tollgate)")
    p.add_argument("--database-url", help="SQLAlchemy URL (default $TOLLGATE_DATABASE_URL or SQLite under home)")
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    serve.register(sub)
    core.register(sub)
    budgets.register(sub)
    reports.register(sub)
    admin.register(sub)
    adapters.register(sub)
    return p


EXIT_BROKEN_PIPE = 141  # as a command killed by SIGPIPE exits (128 + 13)


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a reader gone before the last write is a broken pipe too
        return code
    except BrokenPipeError:
        # the reader went away (`platform keys list | head -1`): stop quietly; what is still buffered for stdout
        # goes to /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = Settings.load(home=args.home, database_url=args.database_url)
        return int(args.func(args, settings) or 0)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return EXIT_USAGE
    except NoPlatform as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_PLATFORM
