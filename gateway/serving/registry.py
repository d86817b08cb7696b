"""Keeps a gateway's models in step with the model applications on the cluster: a thread reads
serve.status(), the recorded specs and run-time adapters, and swaps in a new DeployedModels (gateway/deployed.py). A
model's state comes from its application: no running replica is `scaled_to_zero` (a request starts
one), an application that failed to deploy, or whose replicas cannot start, is `unavailable` with
Serve's message as the reason."""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

import ray
from ray import serve

from billing.deployments import deployed_specs
from billing.model_adapters import recorded_adapters
from gateway.adapters import served_adapters
from gateway.backends import BackendState, ModelBackend
from gateway.deployed import DeployedModels
from gateway.embedding_source import read_embedding_model
from gateway.serving.engine_stats_board import board, model_totals
from gateway.serving.names import MODEL_DEPLOYMENT, model_app_name, model_of_app
from gateway.serving.ray_backend import RayModelBackend
from gateway.serving.ray_embedding_backend import RayEmbeddingBackend
from gateway.specs import ModelSpec, SpecError, parse_spec

log = logging.getLogger("tollgate.serve")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


def short_reason(message: str) -> str:
    """Serve's message about a deployment whose replicas fail to start carries the replica's traceback;
    the reason a user needs is its first sentence and the exception's own line."""
    text = _ANSI.sub("", message).strip()
    first = text.split(". ", 1)[0].rstrip(".")
    raised = [m for line in text.splitlines() if (m := _EXCEPTION_LINE.match(line.strip()))]
    if not raised:
        return text if len(text) <= 300 else text[:297] + "..."
    name, detail = raised[-1].groups()
    return f"{first}: {name}: {detail}"


def listed_max_model_len(spec: ModelSpec | None) -> int | None:
    """What /v1/models says a model reads: the spec's max_model_len; for an embedding model without one, what its
    files say it reads (as its replica, and `serve --local`, will use)."""
    if spec is None:
        return None
    if spec.max_model_len is not None or spec.kind != "embedding":
        return spec.max_model_len
    try:
        return _embedding_model_reads(spec.source)
    except ValueError:  # not cached: read again next time; the replica says why it cannot load it
        return None


@functools.lru_cache(maxsize=64)
def _embedding_model_reads(source: str) -> int:
    return read_embedding_model(source).max_seq_length


def _enum(value: Any) -> str:
    return str(getattr(value, "value", value)).rsplit(".", 1)[-1]


def model_state(app: Any) -> tuple[BackendState, dict[str, int], str | None]:
    """(state, replicas by state in lower case, reason) of a model's application in serve.status()."""
    status = _enum(app.status).upper()
    deployment = app.deployments.get(MODEL_DEPLOYMENT)
    replicas = {} if deployment is None else {
        _enum(state).lower(): n for state, n in deployment.replica_states.items() if n}
    message = ((deployment.message if deployment is not None else "") or app.message or "").strip()
    running = replicas.get("running", 0)
    if status == "DELETING":
        return "stopped", replicas, None
    trigger = _enum(deployment.status_trigger).upper() if deployment is not None else ""
    # a replica that died (health check failed) is replaced by Serve: requests wait for it; replicas that
    # fail to start (a bad source, a crashing constructor) will not come up on their own
    if status == "DEPLOY_FAILED" or (status == "UNHEALTHY" and running == 0 and trigger == "REPLICA_STARTUP_FAILED"):
        return "unavailable", replicas, short_reason(message) if message else f"its application is {status}"
    return ("ready" if running else "scaled_to_zero"), replicas, None


class ModelRegistry:
    def __init__(self, gw: Any, db: Any, *, refresh_s: float, cold_start_timeout_s: float) -> None:
        self.gw = gw
        self.db = db
        self.refresh_s = refresh_s
        self.cold_start_timeout_s = cold_start_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-registry", daemon=True)
        self._board = board()

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:
                log.exception("model registry refresh failed")

    def refresh(self) -> None:
        apps = {model: app for name, app in serve.status().applications.items()
                if (model := model_of_app(name)) is not None}
        adapters = self.gw.models.adapters
        version = adapters.version  # read before the database: an add or remove made meanwhile is not undone
        recorded = deployed_specs(self.db)
        added = recorded_adapters(self.db)
        current: dict[str, ModelBackend] = self.gw.models.backends
        backends: dict[str, ModelBackend] = {}
        specs: dict[str, ModelSpec] = {}
        for name, app in apps.items():
            spec = self._spec(name, recorded.get(name))
            backend = current.get(name)
            backend_class = RayEmbeddingBackend if spec is not None and spec.kind == "embedding" else RayModelBackend
            if type(backend) is not backend_class:
                backend = backend_class(name, serve.get_app_handle(model_app_name(name)),
                                        max_model_len=listed_max_model_len(spec),
                                        cold_start_timeout_s=self.cold_start_timeout_s)
            elif spec is not None:
                backend.max_model_len = listed_max_model_len(spec)
            backend.spec = spec
            backend.state, backend.replica_states, backend.reason = model_state(app)
            backends[name] = backend
            if spec is not None:
                specs[name] = spec
        adapters.replace(served_adapters(specs, added), version)
        self.gw.models = DeployedModels(backends, specs, adapters)
        self._read_engine_stats(backends)

    def _read_engine_stats(self, backends: dict[str, ModelBackend]) -> None:
        try:
            posted = ray.get(self._board.read.remote(), timeout=2)
        except Exception as e:  # the board unreachable: the last figures stay, /metrics still answers
            log.debug("engine stats unavailable: %s", type(e).__name__)
            return
        for name, backend in backends.items():
            if isinstance(backend, RayModelBackend):
                backend.engine_stats = model_totals(posted.get(name, []))

    @staticmethod
    def _spec(name: str, data: dict[str, Any] | None) -> ModelSpec | None:
        if data is None:
            return None
        try:
            return parse_spec(data, f"model {name}")
        except SpecError as e:  # a row written by an older version: serve the model, price and route it not
            log.warning("recorded spec of %s no longer validates: %s", name, e)
            return None
