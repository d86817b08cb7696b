"""What the `platform` command (and the dashboard's scale hook) does to models on a Ray cluster: join
it, deploy or update a model's application, scale it, delete it. A spec is checked whole (its engine
block and its source) before anything is recorded or started."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Engine

from billing.deployments import deployment, record_deployments
from gateway.serving.cluster_fit import node_shortfall
from gateway.serving.errors import NoPlatform
from gateway.serving.model_app import model_application
from gateway.serving.names import model_app_name
from gateway.serving.ray_env import SERVE_LOGGING, keep_token_private, ray_init_options
from gateway.settings import Settings
from gateway.specs import ModelSpec, check_source, parse_spec

PLATFORM_ADDRESS_FILE = "ray-address"  # under TOLLGATE_HOME: the cluster `platform up` started or joined


def _recorded_address(settings: Settings) -> str | None:
    """The cluster `platform up` recorded under this home, when something still listens there: a record left by a
    cluster that is gone (a machine restarted, a cluster stopped by hand) is forgotten, not retried for minutes."""
    path = settings.home / PLATFORM_ADDRESS_FILE
    address = (path.read_text().strip() or None) if path.is_file() else None
    if address is not None and not _listens(address):
        logging.getLogger("tollgate.platform").warning("the platform recorded at %s does not answer: forgotten",
                                                       address)
        forget_platform(settings)
        return None
    return address


def _listens(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to a Ray GCS address (`host:port`) opens within timeout_s."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def connect(settings: Settings, *, quiet: bool = True) -> None:
    """Join this home's platform: `--address` / RAY_ADDRESS when given, else the cluster that `platform up`
    recorded under TOLLGATE_HOME. Never some other Ray that happens to run on the machine."""
    import ray

    if ray.is_initialized():
        return
    address = settings.ray_address
    if address is None:
        address = _recorded_address(settings)
    if address is None:
        raise NoPlatform(f"no platform runs for {settings.home} (start it with `platform up`, or name a cluster "
                         "with --address or RAY_ADDRESS)")
    try:
        ray.init(address=address, **ray_init_options(quiet))
    except ConnectionError:
        raise NoPlatform(f"no Ray cluster answers at {address}; start the platform with `platform up`") from None


def start_platform(settings: Settings) -> bool:
    """Join the cluster named by settings.ray_address, or this home's running platform, or start a local Ray
    of its own; then start Serve's HTTP proxy on settings.host:port. True when this process started Ray,
    and so owns the platform (and stops it on exit)."""
    import ray
    from ray import serve

    started = False
    if not ray.is_initialized():
        address = settings.ray_address
        if address is None:
            address = _recorded_address(settings)
        try:
            if address is None:
                raise ConnectionError
            ray.init(address=address, **ray_init_options(quiet=False))
        except ConnectionError:
            if settings.ray_address:
                raise NoPlatform(f"no Ray cluster answers at {settings.ray_address}") from None
            ray.init(address="local", include_dashboard=False, **ray_init_options(quiet=False))
            keep_token_private()
            started = True
    settings.home.mkdir(parents=True, exist_ok=True)
    (settings.home / PLATFORM_ADDRESS_FILE).write_text(ray.get_runtime_context().gcs_address + "\n")
    serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config=SERVE_LOGGING)
    return started


def forget_platform(settings: Settings) -> None:
    """The platform this home recorded is gone (it was stopped)."""
    (settings.home / PLATFORM_ADDRESS_FILE).unlink(missing_ok=True)


def recorded_spec(db: Engine, name: str) -> ModelSpec:
    found = deployment(db, name)
    if found is None:
        raise KeyError(f"model {name!r} was never deployed")
    return parse_spec(found.spec, f"model {name}")


def deploy_model(db: Engine, spec: ModelSpec, settings: Settings, *, check: bool = True,
                 **deployment_options: Any) -> None:
    """Check the source (SpecError naming the field), record the spec and deploy or update its
    application; other models are not touched. Changes to autoscaling or pricing alone update the
    running replicas in place."""
    from ray import serve

    if check:
        check_source(spec)
    record_deployments(db, [spec.model_dump(mode="json")])
    serve.run(model_application(spec, settings, **deployment_options), name=model_app_name(spec.name),
              route_prefix=None, logging_config=SERVE_LOGGING)


def resource_shortfall(spec: ModelSpec) -> str | None:
    """A deploy's warning when no node could hold one replica. A cluster that autoscales may still add such a node,
    so this warns and does not refuse."""
    shortfall = node_shortfall(spec)
    return None if shortfall is None else (f"{shortfall}: its replicas start only once the cluster adds such a node, "
                                           "and requests wait for the cold-start bound")


def deploy_unavailable(db: Engine, spec: ModelSpec, settings: Settings) -> None:
    """A spec whose weights are missing, served as unavailable: its application is deployed with one replica
    that fails to start (once), so Serve, the gateway, `platform status` and the dashboard show the model
    and the replica's reason, and its requests get a 503 naming it instead of a 404."""
    data = spec.model_dump(mode="json")
    data["autoscaling"].update(initial_replicas=1, min_replicas=0, max_replicas=max(1, spec.autoscaling.max_replicas))
    # the replica only reports the missing weights: it needs no GPU, so it is scheduled on any node at once
    data["resources"].update(num_gpus=0, num_cpus=0)
    try:
        deploy_model(db, parse_spec(data, f"model {spec.name}"), settings, check=False, max_constructor_retry_count=1)
    except RuntimeError as e:  # serve.run reports the failed deploy; the application stays, DEPLOY_FAILED
        logging.getLogger("tollgate.platform").info("%s deployed as unavailable: %s", spec.name, type(e).__name__)


def delete_model(name: str) -> None:
    from ray import serve

    if model_app_name(name) not in serve.status().applications:
        raise KeyError(f"model {name!r} is not deployed")
    serve.delete(model_app_name(name))


def scale_model(db: Engine, name: str, settings: Settings, min_replicas: int | None,
                max_replicas: int | None) -> ModelSpec:
    spec = recorded_spec(db, name)
    data = spec.model_dump(mode="json")
    if min_replicas is not None:
        data["autoscaling"]["min_replicas"] = min_replicas
    if max_replicas is not None:
        data["autoscaling"]["max_replicas"] = max_replicas
    new = parse_spec(data, f"model {name}")
    deploy_model(db, new, settings, check=False)  # its source was checked when it was deployed
    return new
