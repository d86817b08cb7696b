"""What the `platform` command (and the dashboard's scale hook) does to models on a Ray cluster: join
it, deploy or update a model's application, scale it, delete it. A spec is checked whole (its engine
block and its source) before anything is recorded or started."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Engine

from billing.deployments import deployment, record_deployments
from gateway.serving.errors import NoPlatform
from gateway.serving.model_app import model_application
from gateway.serving.names import model_app_name
from gateway.settings import Settings
from gateway.specs import ModelSpec, check_source, parse_spec


def connect(address: str | None, *, start_local: bool = False, num_cpus: int | None = None,
            quiet: bool = True) -> bool:
    """Join the Ray cluster at `address` (or the local one); with start_local, start one when none runs.
    True when this process started Ray."""
    import ray

    if ray.is_initialized():
        return False
    if quiet:  # Serve's own logger prints each handle it starts and each app it connects to
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    opts: dict[str, Any] = {"logging_level": logging.ERROR if quiet else logging.WARNING,
                            "log_to_driver": not quiet, "configure_logging": True}
    try:
        ray.init(address=address or "auto", **opts)
        return False
    except ConnectionError:
        if address or not start_local:
            raise NoPlatform(f"no Ray cluster at {address or 'this machine'}; start the platform with "
                             "`platform up`") from None
    ray.init(num_cpus=num_cpus, include_dashboard=False, **opts)
    return True


def start_platform(settings: Settings) -> bool:
    """Join (or start) Ray and start Serve's HTTP proxy on settings.host:port; True when this process
    started Ray, and so owns the platform."""
    from ray import serve

    started = connect(settings.ray_address, start_local=True, quiet=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    return started


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
              route_prefix=None)


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
