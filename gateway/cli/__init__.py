"""The `platform` command. Its subcommands live beside this file: core.py (database, tenants, keys,
usage, cache, settings), budgets.py (end-user and tag budgets), serve.py (the gateway and the Ray Serve
platform), admin.py and reports.py.
Each module's `register(subparsers)` adds its commands; each command runs as func(args, settings)."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from gateway.cli import adapters, admin, budgets, core, reports, serve
from gateway.serving.errors import NoPlatform
from gateway.settings import Settings
from tollgate import envs

EXIT_USAGE = 2
EXIT_NO_PLATFORM = 3


HOME_HELP = "state directory, exactly as $TOLLGATE_HOME (default $TOLLGATE_HOME or ~/.tollgate)"
DATABASE_URL_HELP = "SQLAlchemy URL, exactly as $TOLLGATE_DATABASE_URL (default: SQLite under home)"


def _state_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("--home", default=default, help=HOME_HELP)
    p.add_argument("--database-url", default=default, help=DATABASE_URL_HELP)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser (and its own subcommands'): --home and --database-url may also follow the command
    (`platform serve --local --home X`). Their default is SUPPRESS, so that one given before the command stays."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        _state_options(self, argparse.SUPPRESS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="platform", description="Tollgate: serverless LLM inference "
                                "(`platform settings` lists every TOLLGATE_* variable and its value)")
    _state_options(p, None)
    sub = p.add_subparsers(required=True, metavar="COMMAND", parser_class=_CommandParser)
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


def state_flags_applied(args: argparse.Namespace) -> AbstractContextManager[None]:
    """--home and --database-url mean exactly what TOLLGATE_HOME and TOLLGATE_DATABASE_URL mean, for the whole
    command: the models, exports and caches that read the registry, `platform settings`, and the Ray processes
    the command starts (they inherit its environment)."""
    home = str(Path(args.home).expanduser().absolute()) if args.home else None
    return envs.overridden(TOLLGATE_HOME=home, TOLLGATE_DATABASE_URL=args.database_url)


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        with state_flags_applied(args):
            settings = Settings.load()
            return int(args.func(args, settings) or 0)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return EXIT_USAGE
    except NoPlatform as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_PLATFORM
