"""What `platform status` shows: each model's application state (with the reason when it cannot
serve), replicas by state, the gateway's queue and cold-start counters (wakes among them), and how many replicas
sleep, at which levels, and how often they were pushed down."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve
from sqlalchemy import Engine

from gateway.serving.deploy import recorded_spec
from gateway.serving.engine_stats_board import board
from gateway.serving.names import GATEWAY_APP, model_of_app
from gateway.serving.registry import model_state

log = logging.getLogger("tollgate.platform")


def platform_status(db: Engine | None = None) -> list[dict[str, Any]]:
    st = serve.status()
    gateway_stats: dict[str, dict[str, Any]] = {}
    if GATEWAY_APP in st.applications:
        try:
            gateway_stats = serve.get_app_handle(GATEWAY_APP).stats.remote().result(timeout_s=10)
        except Exception as e:  # the status of the models is still worth showing
            log.warning("gateway stats unavailable: %s", type(e).__name__)
    try:  # each replica's engine stats, as it last posted them (gateway/serving/engine_stats_board.py)
        engine_stats: dict[str, list[dict[str, Any]]] = ray.get(board().read.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - the status of the models is still worth showing
        log.warning("replica engine stats unavailable: %s", type(e).__name__)
        engine_stats = {}
    rows = []
    for app_name, app in sorted(st.applications.items()):
        name = model_of_app(app_name)
        if name is None:
            continue
        state, replicas, reason = model_state(app)
        counters = gateway_stats.get(name, {})
        row: dict[str, Any] = {
            "model": name, "state": state, "replicas": replicas,
            "ongoing": counters.get("ongoing", 0), "waiting_for_replica": counters.get("waiting_for_replica", 0),
            "cold_starts": counters.get("cold_starts", 0), "wakes": counters.get("wakes", 0),
            "cold_start_timeouts": counters.get("cold_start_timeouts", 0),
            "last_cold_start_s": counters.get("last_cold_start_s"),
            **sleep_columns(engine_stats.get(name, [])),
        }
        if db is not None:
            try:
                a = recorded_spec(db, name).autoscaling
                row["min_replicas"], row["max_replicas"] = a.min_replicas, a.max_replicas
            except KeyError:
                pass
        row["reason"] = reason
        rows.append(row)
    return rows


def sleep_columns(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of a model's replicas sleep, at which levels (one per replica, awake ones as 0), and how often they
    were pushed down a level to make room for another model's wake."""
    levels = sorted((int(r.get("sleep_level", 0)) for r in replicas), reverse=True)
    return {"asleep": sum(1 for level in levels if level), "sleep_levels": levels,
            "push_downs": sum(int(r.get("sleep_push_downs", 0)) for r in replicas)}


def replica_states(model: str) -> dict[str, int]:
    """The model's replicas by state (STARTING, RUNNING, STOPPING, ...); empty at zero replicas."""
    from gateway.serving.names import MODEL_DEPLOYMENT, model_app_name

    app = serve.status().applications.get(model_app_name(model))
    if app is None or MODEL_DEPLOYMENT not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): n for k, n in app.deployments[MODEL_DEPLOYMENT].replica_states.items() if n}


def running_replicas(model: str) -> int:
    return replica_states(model).get("RUNNING", 0)
