"""The `platform` command, run as a real subprocess against the test database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.gateway.live import free_port

CLI = [sys.executable, "-m", "gateway.cli"]


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def _env(db_url: str, tmp_path) -> dict[str, str]:
    return {**os.environ, "TOLLGATE_DATABASE_URL": db_url, "TOLLGATE_HOME": str(tmp_path)}


def test_tenants_keys_usage(db_url, tmp_path):
    env = _env(db_url, tmp_path)
    assert _run(env, "db", "upgrade").returncode == 0
    assert _run(env, "tenants", "create", "acme", "--budget-usd", "20").returncode == 0
    assert _run(env, "tenants", "create", "acme").returncode == 2  # already exists
    created = _run(env, "keys", "create", "--tenant", "acme", "--rpm", "60", "--tpm", "1000", "--budget-usd", "5")
    key = created.stdout.strip()
    assert created.returncode == 0 and key.startswith("tg-") and key not in created.stderr
    listed = _run(env, "keys", "list", "--json")
    assert key not in listed.stdout
    [row] = json.loads(listed.stdout)
    assert (row["tenant"], row["rpm"], row["tpm"], row["budget_usd"], row["revoked"]) == ("acme", 60, 1000, 5.0, False)
    assert _run(env, "keys", "revoke", str(row["id"])).returncode == 0
    assert json.loads(_run(env, "keys", "list", "--json").stdout)[0]["revoked"] is True
    assert json.loads(_run(env, "tenants", "list", "--json").stdout)[0]["name"] == "acme"
    usage = _run(env, "usage", "--tenant", "acme", "--since", "2026-01-01", "--group-by", "day,model", "--json")
    assert usage.returncode == 0 and json.loads(usage.stdout) == []


def test_serve_local_answers_and_stops_cleanly(db_url, tmp_path):
    env = _env(db_url, tmp_path)
    _run(env, "tenants", "create", "acme")
    key = _run(env, "keys", "create", "--tenant", "acme").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--local", "--port", str(port), "--models-dir", str(models)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.json() == {"object": "list", "data": []}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "nope", "messages": [{"role": "user", "content": "secret prompt"}]})
        assert r.status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert key not in out and "secret prompt" not in out  # keys and prompts never reach the logs
