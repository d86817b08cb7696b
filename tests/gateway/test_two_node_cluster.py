"""More than one node, on Ray's own cluster: a model pinned by its spec's custom resource to a second node answers
through the gateway on the head node; losing that node gives its requests 503 with Retry-After (never a hang or a
500) until a node with the resource joins again; one usage event per request that ran.

The cluster runs in a process of its own (tests/gateway/two_node_cluster.py): Ray allows one cluster per driver,
and test_serve.py's session-scoped Ray may be connected in this process whatever the test order. The process runs
in its own session and the whole group is killed if it outlives its bound, so the test cannot hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

pytest.importorskip("ray")

from billing.accounts import create_key, create_tenant  # noqa: E402
from billing.db import make_engine  # noqa: E402
from billing.models import UsageEvent  # noqa: E402
from tests.gateway.gateway_process import shared_model_cache  # noqa: E402
from tests.gateway.live import free_port  # noqa: E402
from tests.gateway.two_node_cluster import COLD_START_TIMEOUT_S, RETRY_AFTER_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT_S = 420


def run_scenario(db_url: str, key: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOLLGATE_HOME": str(out.parent / "home"),
           **shared_model_cache()}  # the converted SmolLM2 checkpoint of the other tests' replicas
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.gateway.two_node_cluster", db_url, key, str(free_port()),
                             str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario and the Ray processes it started
        log, _ = proc.communicate()
        pytest.fail(f"the two-node scenario ran past {SCENARIO_TIMEOUT_S} s:\n{log[-4000:]}")
    report = json.loads(out.read_text()) if out.is_file() else {}
    assert proc.returncode == 0, f"{report.get('failed')}\n{log[-6000:]}\n" + "\n".join(report.get("serve_log", []))
    return report


def explained(report: dict, *requests: dict) -> str:
    """What a failed assertion prints: the requests in question (status, body head of a body that is not JSON),
    where the gateway's replica ran, and Serve's warnings and errors from the cluster's logs."""
    log = "\n".join(report.get("serve_log", []))
    return (f"{json.dumps(requests, indent=1)}\ngateway replica on {report.get('gateway_node_before')} (node_b: "
            f"{report.get('node_b')})\nServe's log:\n{log}")


@pytest.mark.slow
def test_a_model_on_a_lost_node_is_503_until_a_node_with_its_resource_joins(db_url: str, tmp_path: Path) -> None:
    db = make_engine(db_url)
    create_tenant(db, "acme")
    key = create_key(db, "acme").key
    report = run_scenario(db_url, key, tmp_path / "report.json")

    # pinned: its replica ran on the second node, never on the head, then on the node that joined
    assert report["replica_node_before"] == report["node_b"] != report["head_node"]
    # the gateway stays on the head node: on node_b it would die with it, and Serve's proxy would answer its
    # requests with a plain-text 500
    assert report["gateway_node_before"] == report["head_node"]
    assert report["replica_node_while_gone"] is None
    assert report["replica_node_after"] == report["node_c"]
    requests = report["requests"]
    by_phase = {p: [r for r in requests if r["phase"] == p] for p in ("before", "in_flight", "node_gone", "node_back")}
    assert [r["status"] for r in by_phase["before"]][-2:] == [200, 200]
    # the request generating on the lost node, and each request while no node has the resource: a 503 to retry
    assert report["in_flight_joined"], explained(report)
    assert by_phase["in_flight"][0]["status"] == 503, explained(report, *by_phase["in_flight"])
    assert len(by_phase["node_gone"]) == 3
    for r in by_phase["in_flight"] + by_phase["node_gone"]:
        assert r["status"] == 503 and r["retry_after"] == str(RETRY_AFTER_S), explained(report, r)
        assert r["error"]["code"] == "model_unavailable", explained(report, r)
    # a request that waited out the cold-start bound is told what the cluster lacks, not that a replica is starting
    assert any("no node of this cluster has what one replica needs (1 CPU, 1 node_b;" in r["error"]["message"]
               for r in by_phase["node_gone"]), explained(report, *by_phase["node_gone"])
    for r in by_phase["in_flight"] + by_phase["node_gone"]:
        assert r["seconds"] < COLD_START_TIMEOUT_S + 40  # bounded (Ray's node-death detection, then the cold-start
        # wait): never a hang
    for r in requests:  # never a 500, never a timeout
        assert r["status"] in (200, 503), explained(report, r)
    assert [r["status"] for r in by_phase["node_back"]][-2:] == [200, 200]

    # the ledger: one ok event per answered request, nothing for the 503s refused before they ran
    answered = {r["request_id"] for r in requests if r["status"] == 200}
    with db.connect() as conn:
        events = conn.execute(select(UsageEvent.request_id, UsageEvent.status)).all()
    assert sorted(rid for rid, status in events if status == "ok") == sorted(answered)
    # the lost request (its 503 carries no request id): a `failed` event with what it generated when its replica had
    # sent its first tokens, none when the node went before them (refused before it ran, like the other 503s)
    assert [status for rid, status in events if rid not in answered] in ([], ["failed"])
    db.dispose()
