"""A model spec as its own Ray Serve application: a ModelServer deployment autoscaled 0..N. Deploying,
updating or deleting a model touches only its own application."""

from __future__ import annotations

import hashlib
import json
import threading
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

from ray.serve import Application

from gateway.serving.embedding_replica import EmbeddingServer
from gateway.serving.replica import ModelServer
from gateway.settings import Settings
from gateway.specs import ModelSpec


# Serve's options() pickles the autoscaling policy with cloudpickle's process-wide register / unregister by value,
# which fails when two threads deploy at once ("... is not registered for pickle by value")
_OPTIONS_LOCK = threading.Lock()


def model_application(spec: ModelSpec, settings: Settings, **deployment_options: Any) -> Application:
    actor_options: dict[str, Any] = {"num_cpus": spec.resources.num_cpus, "num_gpus": spec.resources.num_gpus}
    if spec.resources.memory_gib is not None:
        actor_options["memory"] = int(spec.resources.memory_gib * 2**30)
    if spec.resources.custom:  # the nodes its replicas may run on (a custom resource only they have)
        actor_options["resources"] = dict(spec.resources.custom)
    # autoscaling and pricing stay out of the replicas' arguments, and the version names only what the
    # replicas are built from: changing the replica bounds or prices updates the running replicas in place
    replica_spec = spec.model_dump(mode="json", exclude={"autoscaling", "pricing"})
    args: tuple[Any, ...] = (replica_spec, settings.db_url, settings.interval_flush_s)
    kwargs: dict[str, Any] = {}
    if spec.kind != "embedding":
        if spec.autoscaling.sleep_after_s is not None:
            args += (spec.autoscaling.sleep_after_s,)
        if settings.node_memory_budget_gib is not None:  # the bound of its wakes on a CPU node (node_memory.py)
            kwargs["node_memory_budget_gib"] = settings.node_memory_budget_gib
    version = hashlib.sha256(json.dumps([args, actor_options, _package_version()] + ([kwargs] if kwargs else []),
                                        sort_keys=True).encode())
    deployment_options.setdefault("graceful_shutdown_timeout_s", settings.drain_s)
    server = EmbeddingServer if spec.kind == "embedding" else ModelServer
    with _OPTIONS_LOCK:
        deployment = server.options(
            autoscaling_config=spec.autoscaling.serve_config(),
            max_ongoing_requests=spec.autoscaling.max_ongoing_requests,
            ray_actor_options=actor_options,
            **deployment_options,
        )
    # Serve gives every imperative deploy a random code version (a full restart) unless one is set;
    # `options(version=)` is gone, so set the attribute serve.run reads
    deployment._version = version.hexdigest()[:16]
    return deployment.bind(*args, **kwargs)


def _package_version() -> str:
    try:
        return dist_version("tollgate")
    except PackageNotFoundError:
        return "dev"
