"""What the `platform` command does on a Ray cluster: start or join Ray, deploy the gateway and the
models, and read, scale or delete them. Each model is its own Serve application."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.models import ModelDeployment
from gateway.platform_settings import PlatformSettings
from gateway.specs import ModelSpec, parse_spec


class NoPlatform(RuntimeError):
    pass


def connect(address: str | None, *, start_local: bool = False, num_cpus: int | None = None,
            quiet: bool = True) -> bool:
    """Join the Ray cluster at `address` (or the local one); with start_local, start one when none runs.
    True when this process started Ray."""
    import ray

    if ray.is_initialized():
        return False
    opts: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": not quiet}
    try:
        ray.init(address=address or "auto", **opts)
        return False
    except ConnectionError:
        if address or not start_local:
            raise NoPlatform(f"no Ray cluster at {address or 'this machine'}; start the platform with "
                             "`platform up`") from None
    ray.init(num_cpus=num_cpus, include_dashboard=False, **opts)
    return True


def record_spec(db: Engine, spec: ModelSpec) -> None:
    from gateway.app import register_deployments

    register_deployments(db, [spec])


def recorded_spec(db: Engine, name: str) -> ModelSpec:
    with Session(db) as s:
        row = s.scalar(select(ModelDeployment).where(ModelDeployment.name == name))
    if row is None:
        raise KeyError(f"model {name!r} was never deployed")
    return parse_spec(row.spec, f"model {name}")


def deploy_model(db: Engine, spec: ModelSpec, settings: PlatformSettings, **deployment_options: Any) -> None:
    """Record the spec and deploy or update its application; other models are not touched. Changes to
    autoscaling or pricing alone update the running replicas in place."""
    from ray import serve

    from gateway.serve import model_app_name, model_application

    record_spec(db, spec)
    serve.run(model_application(spec, settings, **deployment_options), name=model_app_name(spec.name), route_prefix=None)


def deploy_gateway(settings: PlatformSettings) -> None:
    from ray import serve

    from gateway.serve import GATEWAY_APP, gateway_application

    serve.run(gateway_application(settings), name=GATEWAY_APP, route_prefix="/")


def delete_model(name: str) -> None:
    from ray import serve

    from gateway.serve import model_app_name

    if model_app_name(name) not in serve.status().applications:
        raise KeyError(f"model {name!r} is not deployed")
    serve.delete(model_app_name(name))


def scale_model(db: Engine, name: str, settings: PlatformSettings, min_replicas: int | None,
                max_replicas: int | None) -> ModelSpec:
    spec = recorded_spec(db, name)
    data = spec.model_dump(mode="json")
    if min_replicas is not None:
        data["autoscaling"]["min_replicas"] = min_replicas
    if max_replicas is not None:
        data["autoscaling"]["max_replicas"] = max_replicas
    new = parse_spec(data, f"model {name}")
    deploy_model(db, new, settings)
    return new


def platform_status(db: Engine | None = None) -> list[dict[str, Any]]:
    """Each model: application status, replicas by state, the gateway's queue and cold-start counters."""
    from ray import serve

    from gateway.serve import GATEWAY_APP, MODEL_APP_PREFIX, MODEL_DEPLOYMENT

    st = serve.status()
    gateway_stats: dict[str, dict[str, Any]] = {}
    if GATEWAY_APP in st.applications:
        try:
            gateway_stats = serve.get_app_handle(GATEWAY_APP).stats.remote().result(timeout_s=10)
        except Exception as e:  # the status of the models is still worth showing
            logging.getLogger("tollgate.platform").warning("gateway stats unavailable: %s", type(e).__name__)
    rows = []
    for app_name, app in sorted(st.applications.items()):
        if not app_name.startswith(MODEL_APP_PREFIX):
            continue
        name = app_name[len(MODEL_APP_PREFIX):]
        dep = app.deployments.get(MODEL_DEPLOYMENT)
        replicas = {_enum(k).lower(): n for k, n in (dep.replica_states.items() if dep else []) if n}
        counters = gateway_stats.get(name, {})
        row: dict[str, Any] = {
            "model": name, "status": _enum(app.status), "replicas": replicas,
            "ongoing": counters.get("ongoing", 0), "waiting_for_replica": counters.get("waiting_for_replica", 0),
            "cold_starts": counters.get("cold_starts", 0), "cold_start_timeouts": counters.get("cold_start_timeouts", 0),
            "last_cold_start_s": counters.get("last_cold_start_s"),
        }
        if db is not None:
            try:
                a = recorded_spec(db, name).autoscaling
                row["min_replicas"], row["max_replicas"] = a.min_replicas, a.max_replicas
            except KeyError:
                pass
        rows.append(row)
    return rows


def replica_states(model: str) -> dict[str, int]:
    """The model's replicas by state (STARTING, RUNNING, STOPPING, ...); empty at zero replicas."""
    from ray import serve

    from gateway.serve import MODEL_DEPLOYMENT, model_app_name

    app = serve.status().applications.get(model_app_name(model))
    if app is None or MODEL_DEPLOYMENT not in app.deployments:
        return {}
    return {_enum(k): n for k, n in app.deployments[MODEL_DEPLOYMENT].replica_states.items() if n}


def running_replicas(model: str) -> int:
    from ray import serve

    from gateway.serve import MODEL_DEPLOYMENT, model_app_name

    app = serve.status().applications.get(model_app_name(model))
    if app is None or MODEL_DEPLOYMENT not in app.deployments:
        return 0
    states = app.deployments[MODEL_DEPLOYMENT].replica_states
    return sum(n for k, n in states.items() if _enum(k) == "RUNNING")


def _enum(value: Any) -> str:
    return str(getattr(value, "value", value))
