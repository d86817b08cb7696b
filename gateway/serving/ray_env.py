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


def use_local_token_auth(address: str | None = None) -> None:
    """Clusters started on this machine once Ray has made its token (~/.ray/auth_token: `platform up`'s own, or
    one started with `ray start --head` after it) use Ray's token auth with that token; Ray turns it on by itself
    only for clusters it finds, not for an address it is given, as the platform's recorded one is or `--address`.
    `address`: a cluster named by the user, joined with the token only when it is on this machine."""
    if "ray" in sys.modules:  # too late to take effect, and a mode Ray's imported half does not share breaks it
        return
    if address is not None and not _on_this_machine(address):
        return
    if (Path.home() / ".ray" / "auth_token").is_file():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def keep_token_private() -> None:
    """Ray writes ~/.ray/auth_token readable by every user of the machine (0644), and whoever holds it can run code
    on the cluster as the platform: once a local cluster has started, it is made the owner's alone (0600)."""
    token = Path.home() / ".ray" / "auth_token"
    try:
        info = token.stat()
    except FileNotFoundError:
        return
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        token.chmod(0o600)


def _on_this_machine(address: str) -> bool:
    """Whether a Ray address (`host:port`, `ray://host:port`, or `auto` / `local`) names a cluster on this machine."""
    import socket

    if address in ("auto", "local"):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    mine: set[str] = set()
    try:
        mine.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the address Ray picks for its nodes:
            probe.connect(("8.8.8.8", 80))  # the outgoing interface's (a UDP connect sends nothing)
            mine.add(probe.getsockname()[0])
    except OSError:
        pass
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs) or any(ip.startswith("127.") for ip in theirs)


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
