"""`platform serve --local --api-servers 2`: two gateway processes on one port over one engine core. Requests through
either are answered and billed once, a budget holds across both, /metrics from either counts both, a worker killed
with SIGKILL leaves the other serving, and SIGTERM drains and stops everything with status 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import func, select

from billing.db import make_engine
from billing.models import Tenant, UsageEvent
from tests.gateway.gateway_process import CLI, cli_env, run_cli
from tests.gateway.live import free_port

SPEC = ("name: tiny\nsource: random:llama-tiny\nsize: small\ntasks: [chat]\n"
        "engine: {device: cpu, engine_core: process, num_kv_blocks: 256, max_num_seqs: 16}\n"
        "pricing: {input_per_1m: 1000.0, output_per_1m: 1000.0}\n")
MAX_TOKENS = 8
# a request's worst case: 3 prompt tokens and MAX_TOKENS at $0.001 each; the budget fits 5 of them
BUDGET_USD = "0.055"


def _children(pid: int, module: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if module in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]


def _wait_all_ready(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    """Every worker answers /health (each fresh connection may land on either)."""
    deadline = time.monotonic() + timeout
    ok = 0
    while ok < 12:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the API processes did not all start"
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            ok = ok + 1 if r.status_code == 200 and r.json()["models"].get("tiny") == "ready" else 0
        except httpx.TransportError:
            ok = 0
        time.sleep(0.05 if ok else 0.3)


def test_two_api_processes_share_one_core_the_budget_and_the_metrics_and_survive_one_killed(db_url, tmp_path):
    env = {**cli_env(db_url, tmp_path), "TOLLGATE_SEMANTIC_CACHE": "0", "TOLLGATE_DRAIN_S": "5",
           "TOLLGATE_KEY_CACHE_TTL_S": "0"}
    admin = "admin-" + os.urandom(8).hex()
    env["TOLLGATE_ADMIN_KEY"] = admin
    assert run_cli(env, "tenants", "create", "acme").returncode == 0
    key = run_cli(env, "keys", "create", "--tenant", "acme").stdout.strip()
    assert run_cli(env, "tenants", "create", "edge", "--budget-usd", BUDGET_USD).returncode == 0
    edge_key = run_cli(env, "keys", "create", "--tenant", "edge").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.yaml").write_text(SPEC)
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--local", "--api-servers", "2", "--port", str(port), "--models-dir",
                             str(models)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_all_ready(proc, port)
        workers = _children(proc.pid, "gateway.cli.api_servers")
        [core] = _children(proc.pid, "engine.core_process")
        assert len(workers) == 2
        base = f"http://127.0.0.1:{port}/v1"

        def ask(api_key: str, i: int) -> int | str:
            # a client of its own per request: a connection of its own, spread over both processes by the kernel
            client = openai.OpenAI(base_url=base, api_key=api_key, max_retries=0)
            try:
                r = client.completions.create(model="tiny", prompt=[1 + i % 7, 2, 3], max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            except openai.RateLimitError as e:
                return e.code or "429"
            finally:
                client.close()

        with ThreadPoolExecutor(24) as pool:
            served = list(pool.map(lambda i: ask(key, i), range(24)))
            at_edge = list(pool.map(lambda i: ask(edge_key, i), range(24)))
        assert served == [MAX_TOKENS] * 24
        admitted = [r for r in at_edge if r == MAX_TOKENS]
        assert 1 <= len(admitted) <= 5 and all(r == "insufficient_quota" for r in at_edge if r != MAX_TOKENS)

        # /metrics from either process counts the requests both answered
        for _ in range(6):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {admin}"}).text
            line = next(ln for ln in text.splitlines() if ln.startswith("tollgate_requests_total{")
                        and 'endpoint="completions"' in ln and 'status="ok"' in ln)
            assert float(line.rsplit(" ", 1)[1]) == 24 + len(admitted)

        os.kill(workers[0], signal.SIGKILL)
        time.sleep(0.5)
        assert [ask(key, i) for i in range(8)] == [MAX_TOKENS] * 8  # every new connection reaches the survivor

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in out, out[-3000:]
    assert "exited with -9" in out  # the killed one is reported; the rest drained
    assert not any(_alive(pid) for pid in [*workers, core])

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(UsageEvent.status, func.count(), func.sum(UsageEvent.cost_usd))
                                .group_by(UsageEvent.status)).all()
            edge_spend = conn.execute(select(func.coalesce(func.sum(UsageEvent.cost_usd), 0))
                                      .join(Tenant, Tenant.id == UsageEvent.tenant_id)
                                      .where(Tenant.name == "edge")).scalar_one()
    finally:
        engine.dispose()
    counts = {status: n for status, n, _ in rows}
    assert counts.get("ok", 0) == 24 + len(admitted) + 8
    assert Decimal(edge_spend) <= Decimal(BUDGET_USD)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("flags, cache, message", [
    (["--api-servers", "0"], "1", "--api-servers (TOLLGATE_API_SERVERS): 0 is not between 1 and 64"),
    (["--api-servers", "2"], "1", "--api-servers (TOLLGATE_API_SERVERS): more than one API process needs the semantic cache off"),
    (["--api-servers", "2", "--port", "TAKEN"], "0", "port: cannot listen on 127.0.0.1:"),
    # another server sharing its port the same way (SO_REUSEPORT, same user) is not joined either
    (["--api-servers", "2", "--port", "SHARED"], "0", "port: cannot listen on 127.0.0.1:"),
])
def test_api_servers_that_cannot_serve_are_refused_naming_the_setting(db_url, tmp_path, flags, cache, message):
    env = {**cli_env(db_url, tmp_path), "TOLLGATE_SEMANTIC_CACHE": cache}
    with socket.socket() as taken:
        if "SHARED" in flags:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if f in ("TAKEN", "SHARED") else f for f in flags]
        port = [] if "--port" in flags else ["--port", str(free_port())]
        r = subprocess.run([*CLI, "serve", "--local", *port, "--models-dir", str(tmp_path), *flags],
                           env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
