"""A two-node Ray cluster on this machine, run as its own process by test_two_node_cluster.py (a process of its
own: it needs a Ray of its own, and the suite's session-scoped Ray of test_serve.py may be connected in the test
process). The head node runs Serve and the gateway; the second node has the custom resource `node_b`, which the
model's spec asks for, so its replica runs there. The node is killed, then a node with `node_b` joins again.

Usage: python -m tests.gateway.two_node_cluster DB_URL API_KEY PORT OUT_JSON
It writes what each request got (status, Retry-After, request id, seconds) to OUT_JSON; the test judges it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"
MODEL = "smollm2-135m"
COLD_START_TIMEOUT_S = 5.0
RETRY_AFTER_S = 3
NODE_B = {"node_b": 1}


def spec_data() -> dict[str, Any]:
    from gateway.specs import load_spec

    data = load_spec(SPEC_PATH).model_dump(mode="json")
    data["engine"].update(max_model_len=256, max_num_seqs=4, cpu_kv_cache_gib=0.05)
    data["resources"] = {"num_gpus": 0, "num_cpus": 1, "custom": NODE_B}
    # one replica from the deploy on: the test is about losing a node, not about scaling from zero
    data["autoscaling"].update(min_replicas=1, max_replicas=1, initial_replicas=1, downscale_delay_s=600,
                               upscale_delay_s=0.0, look_back_period_s=1.0, metrics_interval_s=0.5)
    return data


def wait_until(predicate, timeout: float, what: str, every: float = 0.25):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
    return value


class Client:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.seen: list[dict[str, Any]] = []

    def chat(self, phase: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"Say hi to {uuid.uuid4().hex[:8]}."}], **extra}
        sent = time.monotonic()
        try:
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {self.key}"})
        except Exception as e:  # noqa: BLE001 - a timeout, a dropped connection: reported
            seen: dict[str, Any] = {"phase": phase, "status": repr(e)}
        else:
            seen = {"phase": phase, "status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "request_id": r.headers.get("x-tollgate-request-id"),
                    "content_type": r.headers.get("content-type")}
            try:
                seen["error"] = r.json().get("error")
            except ValueError as e:  # a body that is not JSON (Serve's proxy's plain-text 500, a cut body): kept
                seen.update(error=None, not_json=repr(e), body_head=r.content[:300].decode(errors="replace"))
        seen["sent_at"], seen["seconds"] = sent, round(time.monotonic() - sent, 3)
        self.seen.append(seen)
        return seen


def replica_node(actors: dict[str, Any], app: str = f"model-{MODEL}") -> str | None:
    """The node id of a live replica actor of the Serve application `app` (Ray's actor table, read from the GCS)."""
    for actor in actors.values():
        if actor.get("State") == "ALIVE" and actor.get("Name", "").startswith(f"SERVE_REPLICA::{app}#"):
            return actor["Address"]["NodeID"]
    return None


def serve_log_problems(session_dir: str, max_lines: int = 120) -> list[str]:
    """The warnings, errors and tracebacks in Serve's log files (controller, proxy, replicas) of the cluster's
    session, each line prefixed by its file: what the gateway and Ray said when a request went wrong."""
    lines: list[str] = []
    for path in sorted(Path(session_dir, "logs", "serve").glob("*.log")):
        keep = False
        for line in path.read_text(errors="replace").splitlines():
            level = line.split(" ", 1)[0]
            if level in ("WARNING", "ERROR", "CRITICAL") or line.startswith("Traceback"):
                keep = True
            elif level in ("INFO", "DEBUG"):  # a line of its own level ends the one before and what followed it
                keep = False
            if keep:
                lines.append(f"{path.name}: {line}")
    return lines[-max_lines:]


def gateway_counters() -> dict[str, Any]:
    from ray import serve

    from gateway.serving.names import GATEWAY_APP

    return serve.get_app_handle(GATEWAY_APP).stats.remote().result(timeout_s=10).get(MODEL, {})


def main(db_url: str, key: str, port: int, out: Path) -> None:
    os.environ.pop("RAY_ADDRESS", None)  # never some other Ray of the machine
    import ray
    from ray import serve
    from ray._private import state as ray_state
    from ray.cluster_utils import Cluster

    from gateway.serving.builders import gateway_builder, model_builder
    from gateway.serving.names import GATEWAY_APP, model_app_name
    from gateway.serving.ray_env import quiet_ray_env

    quiet_ray_env()
    report: dict[str, Any] = {}
    settings = {"database_url": db_url, "semantic_cache": False, "key_cache_ttl_s": 0.0, "registry_refresh_s": 0.25,
                "cold_start_timeout_s": COLD_START_TIMEOUT_S, "retry_after_s": RETRY_AFTER_S, "interval_flush_s": 2.0}
    cluster: Cluster | None = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        node_b = cluster.add_node(num_cpus=1, resources=NODE_B)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # the serve config's builders (platform/kuberay/rayservice.yaml's import paths), as KubeRay runs them
        serve.run(model_builder({"spec": spec_data(), **settings}), name=model_app_name(MODEL), route_prefix=None)
        serve.run(gateway_builder(settings), name=GATEWAY_APP, route_prefix="/")
        report["head_node"] = cluster.head_node.node_id
        report["node_b"] = node_b.node_id
        report["replica_node_before"] = replica_node(ray_state.actors())
        report["gateway_node_before"] = replica_node(ray_state.actors(), GATEWAY_APP)
        client = Client(f"http://127.0.0.1:{port}", key)
        report["requests"] = client.seen  # written out whatever happens next
        wait_until(lambda: client.chat("before")["status"] == 200, 60, "the gateway to answer through node_b")
        client.chat("before")

        # a request generating on node_b when it dies; the gateway's counters say it is past the replica's accept
        in_flight = threading.Thread(target=client.chat, args=("in_flight",),
                                     kwargs={"max_tokens": 200, "ignore_eos": True})
        in_flight.start()
        wait_until(lambda: (lambda c: c.get("ongoing") == 1 and c.get("waiting_for_replica") == 0)(gateway_counters()),
                   30, "the long request to be generating")
        cluster.remove_node(node_b, allow_graceful=False)
        report["node_b_removed_at"] = time.monotonic()
        in_flight.join(90)
        report["in_flight_joined"] = not in_flight.is_alive()
        for _ in range(3):  # no node has node_b now: each request waits at most the cold-start bound
            client.chat("node_gone")
        report["replica_node_while_gone"] = replica_node(ray_state.actors())

        node_c = cluster.add_node(num_cpus=1, resources=NODE_B)
        report["node_c"] = node_c.node_id
        wait_until(lambda: client.chat("node_back")["status"] == 200, 150, "a replica on the new node")
        client.chat("node_back")
        report["replica_node_after"] = replica_node(ray_state.actors())
        serve.delete(GATEWAY_APP)  # its ledger drains into the database before the cluster goes
    except BaseException as e:
        report["failed"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if cluster is not None:
            try:
                report["serve_log"] = serve_log_problems(cluster.head_node.get_session_dir_path())
            except OSError as e:
                report["serve_log"] = [f"Serve's logs not read: {e!r}"]
        out.write_text(json.dumps(report))
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
