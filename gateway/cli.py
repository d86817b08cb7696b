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
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if type(e).__name__ != "NoPlatform":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="platform", description="Tollgate: serverless LLM inference")
    p.add_argument("--home", help="state directory (default $TOLLGATE_HOME or ~/.tollgate)")
    p.add_argument("--database-url", help="SQLAlchemy URL (default $TOLLGATE_DATABASE_URL or SQLite under home)")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway and every spec in the models directory")
    serve.add_argument("--local", action="store_true", help="run the models in this process (no Ray)")
    serve.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--models-dir", type=Path, help="directory of model specs (default platform/models)")
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="start (or join) Ray and serve the platform with the bundled model and a demo key")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    up.set_defaults(func=cmd_up)

    deploy = sub.add_parser("deploy", help="validate a model spec, record it and deploy or update the model")
    deploy.add_argument("spec", type=Path)
    deploy.add_argument("--address", help="Ray cluster address (default: the local platform)")
    deploy.set_defaults(func=cmd_deploy)

    status = sub.add_parser("status", help="each model's replicas by state, queue and cold starts")
    status.add_argument("--json", action="store_true")
    status.add_argument("--address")
    status.set_defaults(func=cmd_status)

    delete = sub.add_parser("delete", help="delete a model's application (other models keep running)")
    delete.add_argument("name")
    delete.add_argument("--address")
    delete.set_defaults(func=cmd_delete)

    scale = sub.add_parser("scale", help="change a model's replica bounds")
    scale.add_argument("name")
    scale.add_argument("--min", type=int, dest="min_replicas")
    scale.add_argument("--max", type=int, dest="max_replicas")
    scale.add_argument("--address")
    scale.set_defaults(func=cmd_scale)

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
    usage.add_argument("--user", help="only this end user (the requests' `user` field)")
    usage.add_argument("--tag", help="only events carrying this tag (a key's project or a request's metadata.tags)")
    usage.add_argument("--group-by", default="day,model", help="comma list of day,month,model,tenant,key,user,status")
    usage.add_argument("--gpu", action="store_true", help="replica time per model and day: alive, busy, idle rate")
    usage.add_argument("--model", help="with --gpu: only this model")
    usage.add_argument("--json", action="store_true")
    usage.set_defaults(func=cmd_usage)

    cache = sub.add_parser("cache", help="semantic cache")
    c_sub = cache.add_subparsers(required=True, metavar="ACTION")
    ce = c_sub.add_parser("eval", help="hit and false-hit rates of the shipped cache on {a, b, duplicate} pairs")
    ce.add_argument("--pairs", type=Path, required=True, help='JSONL of {"a", "b", "duplicate"}')
    ce.add_argument("--json", action="store_true")
    ce.set_defaults(func=cmd_cache_eval)

    from gateway import cli_admin, cli_reports

    load = lambda a: Settings.load(home=a.home, database_url=a.database_url)  # noqa: E731
    cli_reports.register(sub, load)
    cli_admin.register(sub, load)
    return p


def cmd_cache_eval(args: argparse.Namespace, _: Settings) -> int:
    from cache import eval as cache_eval

    return cache_eval.main(["--pairs", str(args.pairs)] + (["--json"] if args.json else []))


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

    if args.gpu:
        from billing.gpu_usage import gpu_usage_frame

        frame = gpu_usage_frame(_db(settings), model=args.model, since=args.since, until=args.until)
        _print_frame(frame, args.json, "no replica time recorded")
        return 0
    groups = tuple(g.strip() for g in args.group_by.split(",") if g.strip())
    frame = usage_frame(_db(settings), tenant=args.tenant, since=args.since, until=args.until, group_by=groups,
                        user=args.user, tag=args.tag)
    if args.json:
        print(frame.to_json(orient="records"))
    elif frame.empty:
        print("no usage")
    else:
        print(frame.to_string(index=False))
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.local:
        settings = Settings.load(home=args.home, database_url=args.database_url, host=args.host, port=args.port,
                                 models_dir=args.models_dir)
        _serve_local(settings)
        return 0
    from gateway.specs import load_specs

    ps = _platform_settings(args, host=args.host, port=args.port, models_dir=args.models_dir)
    return _serve_platform(ps, load_specs(ps.models_dir), key=None)


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.specs import load_spec

    ps = _platform_settings(args, host=args.host, port=args.port)
    key = demo_key(ps, _db(ps))
    return _serve_platform(ps, [load_spec(ps.models_dir / BUNDLED_SPEC)], key=key)


def _platform_settings(args: argparse.Namespace, **overrides: object):  # type: ignore[no-untyped-def]
    from gateway.platform_settings import PlatformSettings

    return PlatformSettings.load(home=args.home, database_url=args.database_url,
                                 ray_address=getattr(args, "address", None), **overrides)


def _serve_platform(ps, specs: list, key: str | None) -> int:  # type: ignore[no-untyped-def]
    """Start or join Ray, deploy the models and the gateway, print how to call it, serve until stopped."""
    import signal
    import time

    from ray import serve

    from gateway import platform_ops as ops

    db = _db(ps)
    _prepare_checkpoints(specs)
    started = ops.connect(ps.ray_address, start_local=True, quiet=False)
    serve.start(http_options={"host": ps.host, "port": ps.port})
    for spec in specs:
        ops.deploy_model(db, spec, ps)
    ops.deploy_gateway(ps)
    url = f"http://{ps.host}:{ps.port}"
    model = specs[0].name if specs else "MODEL"
    print(f"Tollgate is serving at {url}/v1 on Ray Serve; models: {', '.join(s.name for s in specs) or 'none'}")
    print("models start on their first request (scale to zero when idle); Ctrl-C stops the platform")
    if key is not None:
        print(f"demo tenant {DEMO_TENANT!r}, API key: {key}")
    print("try:")
    print(f"  curl {url}/v1/chat/completions -H 'Authorization: Bearer {key or '$TOLLGATE_KEY'}' "
          "-H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          "\"max_tokens\": 32}'")
    sys.stdout.flush()

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    if started:
        print("stopping the platform", file=sys.stderr)
        serve.shutdown()
        import ray

        ray.shutdown()
    else:
        print("left the platform running on the Ray cluster", file=sys.stderr)
    return 0


def _prepare_checkpoints(specs: list) -> None:  # type: ignore[type-arg]
    """Convert GGUF sources here once, so that even the first cold start on this node loads fast."""
    from gateway.model_cache import prepared_source

    for spec in specs:
        try:
            prepared_source(spec.source)
        except (ValueError, OSError) as e:  # the replica reports a bad source when it starts
            print(f"note: {spec.name}: source not prepared here ({e})", file=sys.stderr)


def cmd_deploy(args: argparse.Namespace, settings: Settings) -> int:
    from gateway import platform_ops as ops
    from gateway.specs import load_spec

    spec = load_spec(args.spec)  # validation first: a bad spec never reaches the cluster
    ps = _platform_settings(args)
    db = _db(ps)
    ops.connect(ps.ray_address)
    ops.deploy_model(db, spec, ps)
    print(f"deployed {spec.name} (replicas {spec.autoscaling.min_replicas}..{spec.autoscaling.max_replicas}, "
          f"num_gpus {spec.resources.num_gpus:g})")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from gateway import platform_ops as ops

    ps = _platform_settings(args)
    ops.connect(ps.ray_address)
    rows = ops.platform_status(_db(ps))
    if args.json:
        print(json.dumps(rows))
        return 0
    flat = [{**r, "replicas": ", ".join(f"{k}={v}" for k, v in r["replicas"].items()) or "0"} for r in rows]
    _print_rows(flat, False)
    return 0


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    from gateway import platform_ops as ops

    ps = _platform_settings(args)
    ops.connect(ps.ray_address)
    ops.delete_model(args.name)
    print(f"deleted {args.name}")
    return 0


def cmd_scale(args: argparse.Namespace, settings: Settings) -> int:
    from gateway import platform_ops as ops

    if args.min_replicas is None and args.max_replicas is None:
        raise ValueError("scale: give --min and/or --max")
    ps = _platform_settings(args)
    db = _db(ps)
    ops.connect(ps.ray_address)
    spec = ops.scale_model(db, args.name, ps, args.min_replicas, args.max_replicas)
    print(f"{spec.name}: replicas {spec.autoscaling.min_replicas}..{spec.autoscaling.max_replicas}")
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


def _print_frame(frame, as_json: bool, empty: str) -> None:  # type: ignore[no-untyped-def]
    if as_json:
        print(frame.to_json(orient="records"))
    elif frame.empty:
        print(empty)
    else:
        print(frame.to_string(index=False))


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
