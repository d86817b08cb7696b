"""Ray's settings for the platform's processes, in one place: the environment (set before Ray is imported: it
reads it at import and at `ray.init`), `ray.init`'s logging options, and the logging config of Serve's controller,
proxy and replicas.

What a user of `platform up` sees is our own lines (the welcome, the curl, the drain message) and Ray's warnings
and errors: a replica that fails to start still prints why (Serve logs it at ERROR, forwarded to the terminal by
`log_to_driver`). Ray's INFO chatter (each replica added or removed, each route table, Serve's access log) stays out
of the terminal; Ray's own log files still hold its core logs (/tmp/ray/session_latest/logs), Serve's hold
warnings and errors."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

# Ray core in this process: errors only (not the notices of ray.init: token auth turned on, /dev/shm's size)
RAY_CORE_LOG_LEVEL = logging.ERROR
# Serve, here and in its controller, proxy and replicas: warnings too (a replica that cannot be scheduled for lack
# of a GPU, or fails its health checks), not each replica added or removed, each route table, each request
SERVE_LOG_LEVEL = logging.WARNING
# serve.start (controller, proxy) and serve.run (every deployment of the application without its own config)
SERVE_LOGGING: dict[str, Any] = {"log_level": logging.getLevelName(SERVE_LOG_LEVEL), "enable_access_log": False}
QUIET_ENV = {
    # "Task ServeController.listen_for_change failed. There are infinite retries remaining ..." pushed to the
    # driver each time serve.shutdown() stops the controller: a notice of a retry, not an error (a task that
    # finally fails still raises to its caller)
    "RAY_enable_output_error_log_if_still_retry": "0",
    # the "Loading weights" progress bars of models loaded in replicas (the semantic cache's embedder)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def use_local_token_auth() -> None:
    """The cluster `platform up` started on this machine uses Ray's token auth with this machine's token
    (~/.ray/auth_token); Ray turns it on by itself only for clusters it finds, not for an address it is
    given, as the platform's recorded one is."""
    if "ray" in sys.modules:  # too late to take effect, and a mode Ray's imported half does not share breaks it
        return
    if (Path.home() / ".ray" / "auth_token").is_file():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def quiet_ray_env() -> None:
    """Before `ray.init`: a local cluster this process starts inherits the environment. A value set already wins."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def ray_init_options(quiet: bool) -> dict[str, Any]:
    """`ray.init`'s logging options, with the environment and Serve's logger in this process set. `quiet` (a
    command that only talks to the cluster): no output of the cluster's processes. Otherwise (the process that
    serves the platform) their warnings and errors are printed here (`log_to_driver`)."""
    from ray import serve  # noqa: F401  importing it sets its logger in this process to INFO; set it after

    quiet_ray_env()
    # the logger of Serve's calls in this process: "Started Serve", "Application ... is ready", each handle
    logging.getLogger("ray.serve").setLevel(SERVE_LOG_LEVEL)
    return {"logging_level": RAY_CORE_LOG_LEVEL, "log_to_driver": not quiet, "configure_logging": True}
