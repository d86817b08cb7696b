"""The `platform` command: serve the gateway, manage tenants and keys, read usage, migrate."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from gateway.settings import Settings

DEMO_TENANT = "demo"
BUNDLED_SPEC = "smollm2-135m.yaml"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = Settings.load(home=args.home, database_url=args.database_url)
    try:
        return int(args.func(args, settings) or 0)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="platform", description="Tollgate: serverless LLM inference")
    p.add_argument("--home", help="state directory (default $TOLLGATE_HOME or ~/.tollgate)")
    p.add_argument("--database-url", help="SQLAlchemy URL (default $TOLLGATE_DATABASE_URL or SQLite under home)")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--local", action="store_true", help="run the models in this process (no Ray)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--models-dir", type=Path, help="directory of model specs (default platform/models)")
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="run the local platform with the bundled model and a demo key")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.set_defaults(func=cmd_up)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(required=True, metavar="ACTION")
    db_sub.add_parser("upgrade", help="apply migrations").set_defaults(func=cmd_db_upgrade)

    tenants = sub.add_parser("tenants", help="tenants")
    t_sub = tenants.add_subparsers(required=True, metavar="ACTION")
    tc = t_sub.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--budget-usd", type=float, help="monthly budget in USD")
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
    kc.add_argument("--budget-usd", type=float, help="monthly budget in USD")
    kc.add_argument("--name")
    kc.add_argument("--project", help="a tag put on every usage event of this key")
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
    usage.add_argument("--since", type=_date, help="YYYY-MM-DD (inclusive, UTC)")
    usage.add_argument("--until", type=_date, help="YYYY-MM-DD (exclusive, UTC)")
    usage.add_argument("--group-by", default="day,model", help="comma list of day,month,model,tenant,key,user,status")
    usage.add_argument("--json", action="store_true")
    usage.set_defaults(func=cmd_usage)
    return p


def _date(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def _db(settings: Settings, migrate: bool = True):  # type: ignore[no-untyped-def]
    from billing.db import make_engine
    from billing.migrate import upgrade

    if migrate:
        upgrade(settings.db_url)
    return make_engine(settings.db_url)


def cmd_db_upgrade(args: argparse.Namespace, settings: Settings) -> int:
    from billing.migrate import upgrade

    upgrade(settings.db_url)
    print("database is at the latest revision")
    return 0


def cmd_tenants_create(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import create_tenant

    tenant = create_tenant(_db(settings), args.name, args.budget_usd)
    print(f"created tenant {tenant.name} (id {tenant.id})")
    return 0


def cmd_tenants_list(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import list_tenants

    rows = [{"id": t.id, "name": t.name, "budget_usd": t.budget_usd, "created_at": t.created_at.isoformat()}
            for t in list_tenants(_db(settings))]
    _print_rows(rows, args.json)
    return 0


def cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import create_key

    created = create_key(_db(settings), args.tenant, rpm=args.rpm, tpm=args.tpm, budget_usd=args.budget_usd,
                         name=args.name, project=args.project)
    print(created.key)
    print(f"key id {created.id} for tenant {created.tenant}; it is shown only once", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import list_keys

    rows = [{"id": k.id, "prefix": k.prefix + "...", "tenant": k.tenant, "name": k.name, "project": k.project,
             "rpm": k.rpm, "tpm": k.tpm, "budget_usd": k.budget_usd, "revoked": k.revoked,
             "created_at": k.created_at.isoformat()} for k in list_keys(_db(settings), args.tenant)]
    _print_rows(rows, args.json)
    return 0


def cmd_keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from billing.accounts import revoke_key

    key_id = revoke_key(_db(settings), args.key)
    print(f"revoked key {key_id}")
    return 0


def cmd_usage(args: argparse.Namespace, settings: Settings) -> int:
    from billing.usage import usage_frame

    groups = tuple(g.strip() for g in args.group_by.split(",") if g.strip())
    frame = usage_frame(_db(settings), tenant=args.tenant, since=args.since, until=args.until, group_by=groups)
    if args.json:
        print(frame.to_json(orient="records"))
    elif frame.empty:
        print("no usage")
    else:
        print(frame.to_string(index=False))
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    if not args.local:
        print("error: only --local is available (models run in this process); Ray Serve comes later",
              file=sys.stderr)
        return 2
    settings = Settings.load(home=args.home, database_url=args.database_url, host=args.host, port=args.port,
                             models_dir=args.models_dir)
    _serve_local(settings)
    return 0


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    settings = Settings.load(home=args.home, database_url=args.database_url, host=args.host, port=args.port)
    db = _db(settings)
    key = demo_key(settings, db)
    url = f"http://{settings.host}:{settings.port}"
    print(f"Tollgate is starting at {url}/v1 (the model loads first; Ctrl-C stops it)")
    print(f"demo tenant {DEMO_TENANT!r}, API key: {key}")
    print("try:")
    print(f"  curl {url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
          "-H 'Content-Type: application/json' "
          "-d '{\"model\": \"smollm2-135m\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
          "\"max_tokens\": 32}'")
    sys.stdout.flush()
    _serve_local(settings, only_spec=BUNDLED_SPEC)
    return 0


def demo_key(settings: Settings, db) -> str:  # type: ignore[no-untyped-def]
    """The demo key is created on the first run and kept (mode 0600) under the home directory."""
    from billing.accounts import create_key, get_or_create_tenant, key_is_active

    path = settings.home / "demo_key"
    if path.exists():
        key = path.read_text().strip()
        if key_is_active(db, key):
            return key
    get_or_create_tenant(db, DEMO_TENANT)
    key = create_key(db, DEMO_TENANT, name="demo").key
    settings.home.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def _serve_local(settings: Settings, only_spec: str | None = None) -> None:
    import logging

    import uvicorn

    from gateway.app import create_app
    from gateway.backends import LocalEngineBackend, ModelBackend
    from gateway.specs import load_spec, load_specs

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if only_spec is not None:
        specs = [load_spec(settings.models_dir / only_spec)]
    else:
        specs = load_specs(settings.models_dir)
    db = _db(settings)
    backends: dict[str, ModelBackend] = {s.name: LocalEngineBackend(s) for s in specs}
    app = create_app(settings, db, backends, specs, own_backends=True)
    # the access log prints paths and status codes only: never headers (keys) or bodies (prompts)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, timeout_graceful_shutdown=10)


def _print_rows(rows: list[dict], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        print("none")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    sys.exit(main())
