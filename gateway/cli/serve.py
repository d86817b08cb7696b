"""`platform serve`, `up`, `deploy`, `status`, `scale` and `delete`: the gateway in this process
(`serve --local`) or the Ray Serve platform. Ray is imported only by the commands that use it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from billing.migrate import open_database
from gateway.cli.output import print_rows
from gateway.serving.ray_env import use_local_token_auth
from gateway.settings import Settings
from gateway.specs import ModelSpec, check_source, load_spec, load_specs

DEMO_TENANT = "demo"
BUNDLED_SPECS = ("smollm2-135m.yaml", "all-minilm-l6-v2.yaml")  # the chat model and the default embedding model
log = logging.getLogger("tollgate.cli")


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the gateway and every valid spec in the models directory")
    serve.add_argument("--local", action="store_true", help="run the models in this process (no Ray)")
    serve.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--models-dir", type=Path, help="directory of model specs (default platform/models)")
    serve.add_argument("--api-servers", type=int, metavar="N",
                       help="with --local: N gateway processes in front of one engine core per model (default 1)")
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="start (or join) Ray and serve the platform with the bundled models and a demo key")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    up.set_defaults(func=cmd_up)

    deploy = sub.add_parser("deploy", help="check a model spec whole, record it and deploy or update the model")
    deploy.add_argument("spec", type=Path)
    deploy.add_argument("--address", help="Ray cluster address (default: the local platform)")
    deploy.set_defaults(func=cmd_deploy)

    status = sub.add_parser("status", help="each model's state (and why it cannot serve), replicas, queue, cold starts")
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


def _with_flags(args: argparse.Namespace, settings: Settings, **flags: object) -> Settings:
    values = {"ray_address": getattr(args, "address", None), **flags}
    settings = settings.model_copy(update={k: v for k, v in values.items() if v is not None})
    use_local_token_auth(settings.ray_address)  # this home's own platform (its recorded address) or --address
    return settings


def _log_setup(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- serve --local ---------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    settings = _with_flags(args, settings, host=args.host, port=args.port, models_dir=args.models_dir,
                           api_servers=args.api_servers)
    if args.local:
        _log_setup(settings)
    if settings.api_servers != 1 and not args.local:
        raise ValueError("--api-servers (TOLLGATE_API_SERVERS): only `serve --local` runs several API processes")
    found = load_specs(settings.models_dir)
    for problem in found.errors.values():
        log.error("not serving a spec: %s", problem)
    if args.local and settings.api_servers != 1:
        from gateway.cli.api_servers import serve_fronts

        return serve_fronts(settings)
    if args.local:
        from gateway.cli.local_server import serve_local

        serve_local(settings, found.specs, refused_specs=[Path(p).name for p in found.errors])
        return 0
    return serve_platform(settings, found.specs, key=None)


# ---- the Ray Serve platform ------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    settings = _with_flags(args, settings, host=args.host, port=args.port)
    key = demo_key(settings)
    return serve_platform(settings, [load_spec(settings.models_dir / name) for name in BUNDLED_SPECS], key=key)


def serve_platform(settings: Settings, specs: list[ModelSpec], key: str | None) -> int:
    """Start or join Ray, deploy the models and the gateway, print how to call it, serve until stopped."""
    from gateway.serving.deploy import deploy_model, deploy_unavailable, start_platform
    from gateway.serving.gateway_app import deploy_gateway
    from gateway.serving.model_cache import prepared_source

    db = open_database(settings.db_url)
    started = start_platform(settings)
    deployed = []
    for spec in specs:
        try:
            check_source(spec)
        except ValueError as e:
            print(f"{spec.name} is unavailable: {e}", file=sys.stderr)
            deploy_unavailable(db, spec, settings)
            continue
        try:  # convert a GGUF source here once, so that even the first cold start on this node loads fast
            if spec.kind == "chat":
                prepared_source(spec.source)
        except (ValueError, OSError) as e:
            print(f"note: {spec.name}: source not prepared here ({e})", file=sys.stderr)
        deploy_model(db, spec, settings, check=False)
        deployed.append(spec)
    deploy_gateway(settings)
    _print_welcome(settings, deployed, key)
    return run_until_stopped(settings, owns_platform=started)


def run_until_stopped(settings: Settings, owns_platform: bool) -> int:
    """Wait for SIGTERM or Ctrl-C; then, if this process started the platform, drain and stop it."""
    wait_for_stop_signal()
    if not owns_platform:
        print("left the platform running on the Ray cluster", file=sys.stderr)
        return 0
    from gateway.serving.stop import ClusterGone, stop_platform

    print(f"stopping the platform (in-flight requests may finish for up to {settings.drain_s:g} s)", file=sys.stderr)
    try:
        left = stop_platform(settings)
    except ClusterGone:
        print("Ray's own processes stopped with the same signal (it reached the whole process group): the requests "
              "in flight ended with them, nothing was drained; the platform has stopped", file=sys.stderr, flush=True)
        os._exit(1)  # Ray's shutdown in this process would wait 60 s for the GCS that is gone
    if left:
        print(f"{left} requests were still running after the drain window: each was ended (a 503, or an error event "
              "before its stream's end) and recorded cancelled with the tokens it generated", file=sys.stderr)
    print("the platform has stopped", file=sys.stderr)
    return 0


def wait_for_stop_signal() -> None:
    """Block until SIGTERM or SIGINT (Ctrl-C)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_welcome(settings: Settings, specs: list[ModelSpec], key: str | None) -> None:
    url = f"http://{settings.host}:{settings.port}"
    chat = [s.name for s in specs if s.kind == "chat"]
    embedding = [s.name for s in specs if s.kind == "embedding"]
    model = chat[0] if chat else "MODEL"
    print(f"Tollgate is serving at {url}/v1 on Ray Serve; models: {', '.join(s.name for s in specs) or 'none'}")
    print("models start on their first request (scale to zero when idle); Ctrl-C stops the platform")
    if key is not None:
        print(f"demo tenant {DEMO_TENANT!r}, API key: {key}")
        print(f"the README's examples read the key from $TOLLGATE_KEY: export TOLLGATE_KEY={key}")
    if key is None:
        print("make a key with `platform tenants create NAME` and `platform keys create --tenant NAME`, then "
              "export TOLLGATE_KEY=<the key>")
    print("try:")
    auth = f"-H 'Authorization: Bearer {key}'" if key else '-H "Authorization: Bearer $TOLLGATE_KEY"'
    print(f"  curl {url}/v1/chat/completions {auth} "
          "-H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          "\"max_tokens\": 32}'")
    if embedding:
        print(f"  curl {url}/v1/embeddings {auth} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{embedding[0]}\", \"input\": [\"Hello!\", \"How are you?\"]}}'")
    sys.stdout.flush()


def demo_key(settings: Settings) -> str:
    """The demo key is created on the first run and kept (mode 0600) under the home directory."""
    from billing.accounts import create_key, get_or_create_tenant, key_is_active

    db = open_database(settings.db_url)
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


def cmd_deploy(args: argparse.Namespace, settings: Settings) -> int:
    settings = _with_flags(args, settings)  # before Ray is imported
    from gateway.serving.deploy import connect, deploy_model, resource_shortfall

    spec = load_spec(args.spec)  # the spec whole (engine values too) first: a bad one never reaches the cluster
    check_source(spec)
    db = open_database(settings.db_url)
    connect(settings)
    deploy_model(db, spec, settings, check=False)
    shortfall = resource_shortfall(spec)
    if shortfall is not None:
        print(f"warning: {spec.name}: {shortfall}", file=sys.stderr)
    print(f"deployed {spec.name} (replicas {spec.autoscaling.min_replicas}..{spec.autoscaling.max_replicas}, "
          f"num_gpus {spec.resources.num_gpus:g})")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    settings = _with_flags(args, settings)  # before Ray is imported
    from gateway.serving.deploy import connect
    from gateway.serving.status import platform_status

    db = open_database(settings.db_url)
    connect(settings)
    rows = platform_status(db)
    if args.json:
        print(json.dumps(rows))
        return 0
    flat = [{k: "" if v is None else v for k, v in r.items()} for r in rows]
    for r in flat:
        r["replicas"] = ", ".join(f"{k}={v}" for k, v in r["replicas"].items()) or "0"
        r["sleep_levels"] = ",".join(map(str, r.get("sleep_levels") or [])) or "-"
    print_rows(flat, False)
    return 0


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    settings = _with_flags(args, settings)  # before Ray is imported
    from gateway.serving.deploy import connect, delete_model

    connect(settings)
    delete_model(args.name)
    print(f"deleted {args.name}")
    return 0


def cmd_scale(args: argparse.Namespace, settings: Settings) -> int:
    if args.min_replicas is None and args.max_replicas is None:
        raise ValueError("scale: give --min and/or --max")
    settings = _with_flags(args, settings)  # before Ray is imported
    from gateway.serving.deploy import connect, scale_model

    db = open_database(settings.db_url)
    connect(settings)
    spec = scale_model(db, args.name, settings, args.min_replicas, args.max_replicas)
    print(f"{spec.name}: replicas {spec.autoscaling.min_replicas}..{spec.autoscaling.max_replicas}")
    return 0
