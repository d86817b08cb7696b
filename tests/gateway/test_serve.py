"""The platform on real Ray Serve, SmolLM2 on CPU: scale to zero and back, cold-start headers, replica
intervals, a replica killed mid-stream, and deploy / scale / delete / status. One Ray and one Serve
instance for the session (the `platform` fixture, tests/gateway/serve_platform.py); the model loads once per replica
start (three times in all)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from billing.gpu_usage import gpu_usage_frame  # noqa: E402
from billing.models import GpuShare, ReplicaInterval, UsageEvent  # noqa: E402
from gateway.serving import deploy as ops  # noqa: E402
from gateway.serving import status  # noqa: E402
from gateway.serving.gateway_app import deploy_gateway  # noqa: E402
from gateway.serving.names import GATEWAY_APP, MODEL_APP_PREFIX, model_app_name  # noqa: E402
from gateway.serving.ray_backend import COLD_START_HEADER, REQUEST_ID_HEADER  # noqa: E402
from gateway.specs import ModelSpec, load_spec  # noqa: E402
from tests.gateway.serve_platform import (  # noqa: E402
    DOWNSCALE_S,
    SPEC_PATH,
    Platform,
    lists_model,
    test_spec,
    wait_until,
)


def _shares(db: Engine, interval_ids: list[int]) -> list[GpuShare]:
    with db.connect() as conn:
        return list(conn.execute(select(GpuShare).where(GpuShare.interval_id.in_(interval_ids))).all())


def _intervals(db: Engine, model: str) -> dict[str, list[ReplicaInterval]]:
    with db.connect() as conn:
        rows = conn.execute(select(ReplicaInterval).where(ReplicaInterval.model == model)
                            .order_by(ReplicaInterval.start)).all()
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r.replica, []).append(r)
    return out


def _ts(dt) -> float:  # type: ignore[no-untyped-def]
    from datetime import timezone

    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def test_scale_to_zero_and_back_with_intervals(platform: Platform) -> None:
    m = platform.model
    assert status.running_replicas(m) == 0  # min_replicas 0: nothing runs before the first request
    listed = httpx.get(f"{platform.url}/v1/models", headers={"Authorization": f"Bearer {platform.key}"}).json()
    assert [x["state"] for x in listed["data"] if x["id"] == m] == ["scaled_to_zero"]
    lives = []
    for _ in range(2):
        sent = time.time()
        r = platform.chat()
        answered = time.time()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        cold = float(r.headers[COLD_START_HEADER])
        print(f"cold start {cold:.2f} s, answered in {answered - sent:.2f} s")
        assert 0 < cold <= answered - sent
        assert status.running_replicas(m) == 1
        # warm now: no header
        warm = platform.chat(max_tokens=2)
        assert warm.status_code == 200 and COLD_START_HEADER not in warm.headers
        wait_until(lambda: not status.replica_states(m), 45, "scale to zero (no replica in any state)")
        gone = time.time()
        assert gone - answered >= DOWNSCALE_S - 0.5
        lives.append((sent, answered, gone))
    by_replica = wait_until(lambda: (lambda d: d if len(d) == 2 and all(r[-1].end for r in d.values()) else None)(
        _intervals(platform.db, m)), 10, "both replicas' final intervals")
    spans = sorted(by_replica.values(), key=lambda rows: _ts(rows[0].start))
    for rows, (sent, answered, gone) in zip(spans, lives):
        for a, b in zip(rows, rows[1:]):  # the rows tile the replica's life
            assert abs(_ts(b.start) - _ts(a.end)) < 1e-3
        alive = sum(_ts(r.end) - _ts(r.start) for r in rows)
        assert abs(float(sum(r.busy_s + r.idle_s for r in rows)) - alive) < 1e-3
        # the tenant's shares of each interval add up to it exactly, and its busy time is the tenant's
        shares = _shares(platform.db, [r.id for r in rows])
        assert sum(s.busy_s + s.idle_s for s in shares) == sum(r.busy_s + r.idle_s for r in rows)
        assert sum(s.busy_s for s in shares if s.tenant_uid == platform.tenant_uid) == sum(r.busy_s for r in rows)
        first, last = _ts(rows[0].start), _ts(rows[-1].end)
        assert sent - 0.5 <= first <= answered  # the replica started for this request
        assert answered + DOWNSCALE_S - 1.0 <= last <= gone + 0.5  # and lived until the scale-down
        assert alive == pytest.approx(last - first, abs=1e-3)
        assert 0 < sum(r.busy_s for r in rows) < answered - sent + 10
    frame = gpu_usage_frame(platform.db, model=m)
    assert frame["replicas"].sum() == 2
    assert frame["alive_h"].sum() * 3600 == pytest.approx(
        sum(sum(_ts(r.end) - _ts(r.start) for r in rows) for rows in spans), rel=1e-6)
    assert 0 < frame["idle_rate"].iloc[0] < 1


def test_replica_killed_mid_stream(platform: Platform) -> None:
    m = platform.model
    # logprobs: each delta lists its tokens, so the client can count exactly what it was given
    body = {"model": m, "messages": [{"role": "user", "content": f"Count to {uuid.uuid4().int % 10**6}."}],
            "max_tokens": 400, "logprobs": True,
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    killed = False
    started = time.monotonic()
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {platform.key}"}) as r:
        assert r.status_code == 200
        request_id = r.headers[REQUEST_ID_HEADER]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if not killed and len(events) >= 4:
                [name] = _replica_actors(m)
                ray.kill(ray.get_actor(name, namespace=a_namespace(name)), no_restart=True)
                killed = True
    assert killed and time.monotonic() - started < 60
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    # the error event says the model lost its replica and to try again (a 503's error, as the non-streamed request
    # would get), not an internal error
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "model_unavailable", error
    assert not any('"finish_reason": "length"' in e for e in events)

    def failed() -> UsageEvent | None:
        with platform.db.connect() as conn:
            row = conn.execute(select(UsageEvent).where(UsageEvent.request_id == request_id)).first()
        return row if row is not None and row.status == "failed" else None

    event = wait_until(failed, 10, "the request to be recorded as failed")
    # the ledger records exactly what the client was given before the error, billed as such
    delivered = sum(len((c["choices"][0]["logprobs"] or {}).get("content") or [])
                    for c in map(json.loads, events[:-2]) if c.get("choices"))
    assert 3 <= delivered < 400 and event.completion_tokens == delivered
    assert event.error and event.prompt_tokens > 0
    r2 = platform.chat(max_tokens=4)
    assert r2.status_code == 200, r2.text

    # new replica bounds reach the running replica in place: no restart, no second cold start
    before = _replica_actors(m)
    ops.scale_model(platform.db, m, platform.settings, 0, 2)
    assert ops.recorded_spec(platform.db, m).autoscaling.max_replicas == 2
    time.sleep(1.0)
    assert _replica_actors(m) == before and len(before) == 1


def _replica_actors(model: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{model_app_name(model)}#")}


def a_namespace(actor_name: str) -> str:
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == actor_name:
            return a["namespace"]
    raise LookupError(actor_name)


def test_deploy_scale_delete_status(platform: Platform) -> None:
    m = platform.model
    first_deployed = serve.status().applications[model_app_name(m)].last_deployed_time_s
    other = test_spec("smollm2-other").model_copy(update={"size": "large", "tasks": ["code"]})
    ops.deploy_model(platform.db, other, platform.settings)
    wait_until(lambda: _listed_name(platform, "smollm2-other"), 15, "the second model to be listed")
    rows = {r["model"]: r for r in status.platform_status(platform.db)}
    assert set(rows) == {m, "smollm2-other"}
    assert rows[m]["cold_starts"] >= 3 and rows[m]["state"] in ("ready", "scaled_to_zero")
    assert rows["smollm2-other"]["replicas"] == {} and rows["smollm2-other"]["max_replicas"] == 1
    assert rows["smollm2-other"]["state"] == "scaled_to_zero" and rows["smollm2-other"]["reason"] is None

    # the router sees a model deployed after the gateway started: code goes to the large side
    code = [{"role": "user", "content": "Write a python function that reverses a linked list."}]
    r = httpx.post(f"{platform.url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {platform.key}"},
                   json={"model": "auto", "messages": code, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "model=smollm2-other" in r.headers["x-tollgate-route"] and r.json()["model"] == "smollm2-other"

    ops.scale_model(platform.db, "smollm2-other", platform.settings, 0, 2)
    assert ops.recorded_spec(platform.db, "smollm2-other").autoscaling.max_replicas == 2
    # the gateway's scale hook (the admin dashboard's) does the same from inside the cluster
    serve.get_app_handle(GATEWAY_APP).scale_model.remote("smollm2-other", 0, 3).result(timeout_s=60)
    assert ops.recorded_spec(platform.db, "smollm2-other").autoscaling.max_replicas == 3
    ops.delete_model("smollm2-other")
    wait_until(lambda: not _listed_name(platform, "smollm2-other"), 15, "the second model to go")
    assert not any(a.startswith(MODEL_APP_PREFIX + "smollm2-other") for a in serve.status().applications)
    # the first model was never redeployed
    assert serve.status().applications[model_app_name(m)].last_deployed_time_s == first_deployed
    with pytest.raises(KeyError):
        ops.delete_model("smollm2-other")

    # the CLI joins the running cluster
    env = {"TOLLGATE_DATABASE_URL": platform.db_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           **{k: v for k, v in os.environ.items() if k.startswith("RAY_")}}  # the cluster's token auth
    address = ray.get_runtime_context().gcs_address  # never another Ray that may run on the machine
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "status", "--json", "--address", address], env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["model"] for r in json.loads(out.stdout)] == [m]


def test_no_replica_within_the_bound_is_unavailable(platform: Platform) -> None:
    import asyncio

    from engine.config import SamplingParams
    from gateway.backends import BackendUnavailable, GenerationRequest
    from gateway.serving.ray_backend import RayModelBackend

    data = test_spec("smollm2-never").model_dump(mode="json")
    data["resources"]["num_cpus"] = 64  # no node has that many: its replica never starts
    ops.deploy_model(platform.db, ModelSpec.model_validate(data), platform.settings, graceful_shutdown_timeout_s=1.0)
    backend = RayModelBackend("smollm2-never", serve.get_app_handle(model_app_name("smollm2-never")),
                              max_model_len=512, cold_start_timeout_s=1.5)

    async def first() -> object:
        stream = backend.generate(GenerationRequest("r1", SamplingParams(max_tokens=2), prompt="hi"))
        return await stream.__anext__()

    t = time.monotonic()
    with pytest.raises(BackendUnavailable, match="no replica ready"):
        asyncio.run(first())
    assert 1.4 < time.monotonic() - t < 10
    assert backend.counters.cold_start_timeouts == 1 and backend.counters.waiting_for_replica == 0
    ops.delete_model("smollm2-never")


def test_errors_cross_the_ray_boundary_typed(platform: Platform) -> None:
    """A prompt longer than the context is the same 400 context_length_exceeded as in-process, not a 500; a
    model with no replica is listed as scaled_to_zero; a response carries one x-request-id."""
    long = "hello " * 700  # well over the test spec's 512 tokens
    r = platform.chat(messages=[{"role": "user", "content": long}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["type"] == "invalid_request_error"
    r = platform.chat(max_tokens=2)
    assert r.status_code == 200 and len(r.headers.get_list("x-request-id")) == 1
    assert r.headers[REQUEST_ID_HEADER] == r.json()["id"]


def test_the_replicas_engine_series_reach_the_gateways_metrics(platform: Platform) -> None:
    """Each replica posts its engine's counters (engine_stats_board.py); the gateway's /metrics adds them up per
    model, under vLLM's names."""
    from billing.admin_keys import create_admin_key

    admin = {"Authorization": f"Bearer {create_admin_key(platform.db, 'metrics').key}"}
    assert platform.chat(max_tokens=3).status_code == 200
    model = f'{{model="{platform.model}"}}'

    def scraped() -> str | None:
        text = httpx.get(f"{platform.url}/metrics", headers=admin, timeout=10).text
        generated = [line for line in text.splitlines() if line.startswith(f"tollgate_generation_tokens_total{model}")]
        return text if generated and float(generated[0].rsplit(" ", 1)[1]) >= 3 else None

    text = wait_until(scraped, 30, "the replica's engine counters on the gateway's /metrics", every=0.5)
    for series in ("tollgate_num_requests_running", "tollgate_kv_cache_usage_perc", "tollgate_prefix_cache_queries_total"):
        assert f"{series}{model}" in text, series


def test_a_model_whose_replicas_cannot_start_is_unavailable_with_the_reason(platform: Platform) -> None:
    data = test_spec("smollm2-broken").model_dump(mode="json")
    data["source"] = "/nonexistent/weights"  # past the deploy-time check, as a volume that went away would be
    spec = ModelSpec.model_validate(data)
    ops.deploy_model(platform.db, spec, platform.settings, check=False, max_constructor_retry_count=1)
    wait_until(lambda: _listed_name(platform, "smollm2-broken"), 15, "the broken model to be listed")
    r = platform.chat(model="smollm2-broken", timeout=120)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_unavailable" and "/nonexistent/weights" in error["message"]
    listed = {m["id"]: m for m in httpx.get(f"{platform.url}/v1/models", timeout=5,
                                            headers={"Authorization": f"Bearer {platform.key}"}).json()["data"]}
    assert listed["smollm2-broken"]["state"] == "unavailable"
    assert "/nonexistent/weights" in listed["smollm2-broken"]["reason"]
    [row] = [r for r in status.platform_status(platform.db) if r["model"] == "smollm2-broken"]
    assert row["state"] == "unavailable" and "/nonexistent/weights" in row["reason"]
    # a request now fails at once: the gateway knows, it does not wait for a replica
    t = time.monotonic()
    assert platform.chat(model="smollm2-broken").status_code == 503 and time.monotonic() - t < 5
    ops.delete_model("smollm2-broken")


def _listed_name(p: Platform, name: str) -> bool:
    r = httpx.get(f"{p.url}/v1/models", headers={"Authorization": f"Bearer {p.key}"}, timeout=5)
    return any(m["id"] == name for m in r.json()["data"])


def test_gateway_restarted_with_a_stream_in_flight(platform: Platform) -> None:
    """The gateway application stopped while it streams: its replica first finishes the stream, then its
    lifespan closes the ledger, so that stream's usage is written before the replica is gone; the
    gateway deployed again serves what follows. (A rolling redeploy stops old replicas the same way.)"""
    import threading

    before = _gateway_actors()
    body = {"model": platform.model, "messages": [{"role": "user", "content": f"List {uuid.uuid4().hex[:6]}."}],
            "max_tokens": 64, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    streaming, finished = threading.Event(), threading.Event()

    def consume() -> None:
        with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {platform.key}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        streaming.set()
        finished.set()

    drained_while_streaming = threading.Event()

    def watch() -> None:  # the app must be seen deleting, its replica still up, while the stream goes on
        while not finished.is_set():
            app = serve.status().applications.get(GATEWAY_APP)
            deleting = app is not None and str(app.status).endswith("DELETING")
            if deleting and _gateway_actors() and not finished.is_set():
                drained_while_streaming.set()
                return
            time.sleep(0.1)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert streaming.wait(120), "the stream did not start"
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    serve.delete(GATEWAY_APP)  # returns once the replica has drained and stopped
    watcher.join(10)
    assert drained_while_streaming.is_set()
    assert finished.is_set() and events[-1] == "[DONE]"  # the stream ran to its end first
    assert not _gateway_actors()
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 64
    with platform.db.connect() as conn:  # written by the stopping replica, not later
        event = conn.execute(select(UsageEvent).where(UsageEvent.request_id == chunks[0]["id"])).first()
    assert event is not None and (event.status, event.completion_tokens) == ("ok", 64)

    deploy_gateway(platform.settings)
    wait_until(lambda: lists_model(platform), 60, "the gateway to serve again")
    assert _gateway_actors() and not (_gateway_actors() & before)
    assert platform.chat(max_tokens=2).status_code == 200


def _gateway_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{GATEWAY_APP}#Gateway")}


EMBED_SPEC_PATH = SPEC_PATH.parent / "all-minilm-l6-v2.yaml"
EMBED_TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew by 12%.", "naïve café"]


def test_embedding_model_as_its_own_application(platform: Platform) -> None:
    """The bundled all-MiniLM-L6-v2 spec on Ray Serve (EmbeddingServer): listed with its kind, started by its first
    request (a cold start), the official client's vectors equal sentence-transformers', refusals cross the Ray
    boundary as the same 400s naming the field, and the usage event bills the input tokens."""
    import numpy as np
    import openai
    from sentence_transformers import SentenceTransformer

    from gateway.embedding_source import read_embedding_model

    data = load_spec(EMBED_SPEC_PATH).model_dump(mode="json")
    data["resources"]["num_cpus"] = 0  # beside the chat replica on this 2-CPU cluster
    data["autoscaling"].update(min_replicas=0, max_replicas=1)
    spec = ModelSpec.model_validate(data)
    ops.deploy_model(platform.db, spec, platform.settings)
    try:
        wait_until(lambda: _listed_name(platform, spec.name), 30, "the embedding model to be listed")
        models = httpx.get(f"{platform.url}/v1/models", headers={"Authorization": f"Bearer {platform.key}"}).json()
        kinds = {m["id"]: m["kind"] for m in models["data"]}
        assert kinds[spec.name] == "embedding" and kinds[platform.model] == "chat"
        # what the model reads (its files' max_seq_length), as `serve --local` lists it
        assert {m["id"]: m["max_model_len"] for m in models["data"]}[spec.name] == 256
        client = openai.OpenAI(base_url=platform.url + "/v1", api_key=platform.key, max_retries=0, timeout=180)
        raw = client.embeddings.with_raw_response.create(model=spec.name, input=EMBED_TEXTS, user="bob")
        assert COLD_START_HEADER in raw.headers  # scaled to zero: this request started the replica
        r = raw.parse()
        reference = SentenceTransformer(str(read_embedding_model(spec.source).directory), device="cpu")
        np.testing.assert_allclose(np.asarray([d.embedding for d in r.data]), reference.encode(EMBED_TEXTS),
                                   atol=1e-5, rtol=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=spec.name, input=["fine", "word " * 300])
        assert caught.value.param == "input" and "reads at most 256" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=spec.name, input="hi", dimensions=64)
        assert caught.value.param == "dimensions"
        chat = platform.chat(model=spec.name)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
        def recorded() -> list:
            with platform.db.connect() as conn:
                return list(conn.execute(select(UsageEvent).where(UsageEvent.model == spec.name)).all())

        [event] = wait_until(recorded, 30, "the usage event")
        assert (event.endpoint, event.status, event.end_user) == ("embeddings", "ok", "bob")
        assert event.prompt_tokens == r.usage.prompt_tokens == sum(
            len(reference.tokenizer(t)["input_ids"]) for t in EMBED_TEXTS)
        assert event.completion_tokens == 0 and event.cost_usd > 0
    finally:
        ops.delete_model(spec.name)
        wait_until(lambda: not _listed_name(platform, spec.name), 30, "the embedding model to go")


def test_shared_cache_deployment(platform: Platform) -> None:
    """It redeploys the gateway with the semantic cache as its own deployment (only the stop test follows)."""
    deploy_gateway(platform.settings.model_copy(update={"semantic_cache": True}))
    wait_until(lambda: lists_model(platform), 60, "the gateway with the cache to list the model")
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def ask() -> httpx.Response:
        body = {"model": platform.model, "messages": question, "max_tokens": 6, "temperature": 0.0}
        return httpx.post(f"{platform.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {platform.key}"})

    first = ask()
    assert first.status_code == 200 and first.headers["x-tollgate-cache"] == "miss"
    # the gateway stores the answer after responding; the repeat hits once the store has landed
    again = wait_until(lambda: (r := ask()).headers.get("x-tollgate-cache") == "hit" and r, 30, "a cache hit", 0.5)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    cache_replicas = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(f"SERVE_REPLICA::{GATEWAY_APP}#SemanticCache")}
    assert len(cache_replicas) == 1

    # a flag through the deployment, and the dashboard's per-tenant view of it read back through the deployment
    flagged = httpx.post(f"{platform.url}/v1/cache/feedback", json={"response_id": again.json()["id"]}, timeout=30,
                         headers={"Authorization": f"Bearer {platform.key}"})
    assert flagged.status_code == 200 and flagged.json()["entry_removed"] is True
    from billing.admin_keys import create_admin_key
    from tests.gateway.test_dashboard import csrf_of

    with httpx.Client(base_url=platform.url, timeout=30) as admin:
        form = admin.get("/admin/login")
        signed_in = admin.post("/admin/login", data={"csrf_token": csrf_of(form.text),
                                                     "key": create_admin_key(platform.db, "cache-view").key})
        assert signed_in.status_code == 303
        flags = admin.get("/admin/cache/flags", params={"tenant": "acme", "format": "json"}).json()
        assert [(f["response_id"], f["cached_prompt"], f["entry_removed"]) for f in flags] == [
            (again.json()["id"], "What is the capital of France?", True)]
        [acme] = admin.get("/admin/cache/bounds", params={"tenant": "acme", "format": "json"}).json()
        assert acme["flagged"] == 1 and acme["max_false_hit_rate"] == 0.01

    # the cache deployment down: requests go straight to the model
    [name] = cache_replicas
    ray.kill(ray.get_actor(name, namespace=a_namespace(name)), no_restart=True)
    down = ask()
    assert down.status_code == 200, down.text
    assert down.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


STOP_TOKENS = 128
# the streams must finish inside the drain window: on a loaded 2-core box, while Serve starts a second replica
# beside the first, 5 streams of STOP_TOKENS took over 60 s (the test's own waits below allow 180)
DRAIN_S = 150.0
STOPPER = f"""
import sys
import ray
from gateway.cli.serve import run_until_stopped
from gateway.settings import Settings
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("waiting", flush=True)
sys.exit(run_until_stopped(Settings(drain_s={DRAIN_S}), owns_platform=True))
"""


def test_an_idle_replica_sleeps_and_the_next_request_wakes_it_with_the_same_answer(platform: Platform) -> None:
    """autoscaling.sleep_after_s: the replica's engine sleeps while Ray Serve keeps the replica; a request wakes it,
    answers as before and carries the wake time; the ledger counts the sleep as asleep, not idle."""
    name = "smollm2-sleepy"
    spec = test_spec(name, min_replicas=1, downscale_delay_s=600.0, sleep_after_s=1.0)
    ops.deploy_model(platform.db, spec, platform.settings)
    replica = serve.get_app_handle(model_app_name(name))
    question = [{"role": "user", "content": "Name a colour."}]

    def ask() -> httpx.Response:
        return httpx.post(f"{platform.url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {platform.key}"},
                          json={"model": name, "messages": question, "max_tokens": 6, "temperature": 0.0,
                                 "logprobs": True})  # never a cached answer, which would not wake the replica

    try:
        wait_until(lambda: _listed_name(platform, name), 30, "the sleepy model to be listed")
        wait_until(lambda: replica.stats.remote().result(timeout_s=30)["sleep_level"] == 1, 120,
                   "the idle replica to fall asleep")
        first = ask()  # wakes it
        assert first.status_code == 200, first.text
        assert float(first.headers[COLD_START_HEADER]) > 0
        wait_until(lambda: replica.stats.remote().result(timeout_s=30)["sleep_level"] == 1, 60, "sleep again")
        second = ask()
        assert second.status_code == 200 and float(second.headers[COLD_START_HEADER]) > 0
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        stats = replica.stats.remote().result(timeout_s=30)
        assert stats["wakes"] >= 2 and stats["engine"]["kv_blocks_used"] == 0
        def rows() -> list[ReplicaInterval]:
            return [r for replica_rows in _intervals(platform.db, name).values() for r in replica_rows]

        wait_until(lambda: any(r.asleep_s > 0 for r in rows()), 30, "an interval with asleep time")
        for row in rows():
            span = Decimal((row.end - row.start) // timedelta(microseconds=1)).scaleb(-6)
            assert row.busy_s + row.idle_s + row.asleep_s == span
        assert gpu_usage_frame(platform.db, model=name)["asleep_h"].sum() > 0
        # `platform status`: the wakes among the cold starts, and the replica asleep at level 1
        row = wait_until(lambda: next((r for r in status.platform_status(platform.db) if r["model"] == name
                                       and r["asleep"] == 1), None), 30, "status to show the replica asleep")
        assert row["wakes"] >= 2 and row["cold_starts"] >= row["wakes"]
        assert row["sleep_levels"] == [1] and row["push_downs"] == 0
    finally:
        ops.delete_model(name)
        wait_until(lambda: not _listed_name(platform, name), 30, "the sleepy model to go")


LRU_BUDGET_GIB = 1.6  # SmolLM2 here: weights W 0.50 GiB, KV pool K 0.18: two awake (1.35) fit, three asleep (1.50)
# fit, a wake beside two level-1 sleepers (3W + K = 1.68) does not


def test_a_wake_that_needs_memory_pushes_the_least_recently_used_sleeper_down(platform: Platform) -> None:
    """Three sleepy models on one CPU node under a memory budget (TOLLGATE_NODE_MEMORY_BUDGET_GIB) that fits two
    awake: the wake that does not fit beside two level-1 sleepers first pushes the least recently used one down to
    level 2, not the other; wakes that fit push nothing; every model answers with the same greedy tokens throughout
    (the same weights and question: the same tokens as the first answer); the push-downs show in the replicas' stats
    and on /metrics; the interval rows tile each replica's life."""
    from billing.admin_keys import create_admin_key
    from gateway.serving.node_memory import GIB, node_ledger

    names = ["smollm2-lru-a", "smollm2-lru-b", "smollm2-lru-c"]
    settings = platform.settings.model_copy(update={"node_memory_budget_gib": LRU_BUDGET_GIB})
    ledger = node_ledger()
    question = [{"role": "user", "content": "Name a colour."}]
    handles: dict[str, object] = {}

    def others_recorded() -> set[str]:
        return {r.model for r in ray.get(ledger.records.remote(), timeout=10) if r.model not in names}

    def stats(name: str) -> dict:
        if name not in handles:
            handles[name] = serve.get_app_handle(model_app_name(name))
        return handles[name].stats.remote().result(timeout_s=30)  # type: ignore[attr-defined]

    def asleep(name: str) -> None:
        wait_until(lambda: stats(name)["sleep_level"] >= 1, 60, f"{name} to fall asleep", every=0.25)

    def levels() -> dict[str, tuple[int, int]]:
        return {n: (stats(n)["sleep_level"], stats(n)["push_downs"]) for n in names}

    def ask(name: str, wakes: bool = True) -> str:
        r = httpx.post(f"{platform.url}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {platform.key}"},
                       json={"model": name, "messages": question, "max_tokens": 6, "temperature": 0.0,
                              "logprobs": True})  # never a cached answer, which would not wake the replica
        assert r.status_code == 200, r.text
        assert not wakes or float(r.headers[COLD_START_HEADER]) > 0
        return r.json()["choices"][0]["message"]["content"]

    # nothing else holds memory on the node: the session's model at zero, other tests' replicas gone
    wait_until(lambda: not others_recorded(), 60, "the node's memory record to hold no other replica", every=0.5)
    deployed: list[str] = []
    try:
        def deploy(name: str) -> None:
            spec = test_spec(name, min_replicas=1, downscale_delay_s=600.0, sleep_after_s=1.0)
            spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"num_cpus": 0.25})})
            deployed.append(name)
            ops.deploy_model(platform.db, spec, settings)

        with ThreadPoolExecutor(3) as pool:  # the three replicas start together
            list(pool.map(deploy, names))
        for name in names:
            asleep(name)
        # least recently used first: none has served yet, so the order they started in
        by_use = [r.model for r in sorted(ray.get(ledger.records.remote(), timeout=10), key=lambda r: r.last_used)]
        lru, middle, newest = by_use
        engine = stats(lru)["engine"]
        weights, awake = engine["weights_bytes"], engine["weights_bytes"] + engine["kv_cache_bytes"]
        assert 2 * awake <= LRU_BUDGET_GIB * GIB < 3 * weights + engine["kv_cache_bytes"], (weights, awake)
        assert levels() == {n: (1, 0) for n in names}

        # the newest wakes beside two level-1 sleepers: the least recently used goes down to level 2, the other stays
        answers = [ask(newest)]
        after = levels()
        assert after[lru] == (2, 1) and after[middle] == (1, 0) and after[newest][1] == 0
        # the middle one's wake fits (the pushed one holds nothing now): nothing is pushed
        answers.append(ask(middle))
        assert {n: lv[1] for n, lv in levels().items()} == {lru: 1, middle: 0, newest: 0}
        # the pushed one wakes from level 2 beside the other two asleep: the newest, used before the middle, goes down
        asleep(middle)
        asleep(newest)
        answers.append(ask(lru))
        final = levels()
        assert final[newest] == (2, 1) and final[middle] == (1, 0) and final[lru][1] == 1
        assert answers == [answers[0]] * 3  # the same weights and question: the same greedy tokens, pushed or not

        admin = {"Authorization": f"Bearer {create_admin_key(platform.db, 'lru-metrics').key}"}

        def pushed_on_metrics() -> bool:
            text = httpx.get(f"{platform.url}/metrics", headers=admin, timeout=10).text
            return all(f'tollgate_engine_sleep_push_downs{{model="{n}"}} 1.0' in text for n in (lru, newest))

        wait_until(pushed_on_metrics, 30, "the push-downs on /metrics", every=0.5)

        def rows() -> list[ReplicaInterval]:
            return [r for n in names for replica_rows in _intervals(platform.db, n).values() for r in replica_rows]

        wait_until(lambda: {r.model for r in rows() if r.asleep_s > 0} == set(names), 30, "asleep time for each")
        for row in rows():
            span = Decimal((row.end - row.start) // timedelta(microseconds=1)).scaleb(-6)
            assert row.busy_s + row.idle_s + row.asleep_s == span
    finally:
        for name in deployed:
            with contextlib.suppress(KeyError):  # its deploy failed before its application was made
                ops.delete_model(name)
        wait_until(lambda: not any(_listed_name(platform, n) for n in names), 60, "the three models to go")


def test_sigterm_drains_the_platform_then_stops_it(platform: Platform) -> None:
    """Last in this module: it stops the platform. A process that owns the platform (as `platform up` does)
    gets SIGTERM while 5 streams run: the gateway refuses new requests, the 5 finish and are recorded, then
    Serve shuts down."""
    import signal
    import threading

    address = ray.get_runtime_context().gcs_address
    stopper = subprocess.Popen([sys.executable, "-c", STOPPER, address], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert stopper.stdout is not None and stopper.stdout.readline().strip() == "waiting"
    results: list[list[str]] = [[] for _ in range(5)]
    started = threading.Barrier(6, timeout=180)

    def stream(i: int) -> None:
        # long enough that the drain outlasts the signal's delivery and the check for refusals below
        body = {"model": platform.model, "max_tokens": STOP_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Count slowly, run {i} {uuid.uuid4().hex[:6]}."}]}
        with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {platform.key}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[i].append(line[6:])
                    if len(results[i]) == 2:
                        started.wait()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(5)]
    for t in threads:
        t.start()
    started.wait()
    stopper.send_signal(signal.SIGTERM)
    try:
        late = wait_until(lambda: (r := platform.chat(max_tokens=2)).status_code == 503 and r, 30,
                          "new requests refused")
    except Exception:
        stopper.kill()
        raise AssertionError(f"no 503 while draining; the stopping process said: {stopper.communicate()[0]}")
    assert late.json()["error"]["code"] == "service_unavailable"
    for t in threads:
        t.join(180)
    out, _ = stopper.communicate(timeout=180)
    assert stopper.returncode == 0, out[-3000:]
    ids = []
    for events in results:
        assert events[-1] == "[DONE]" and json.loads(events[-2]).get("usage", {}).get("completion_tokens") == \
            STOP_TOKENS, f"a stream's last events: {events[-3:]}; the stopping process said: {out[-2000:]}"
        ids.append(json.loads(events[0])["id"])
    with platform.db.connect() as conn:
        rows = conn.execute(select(UsageEvent.status, UsageEvent.completion_tokens)
                            .where(UsageEvent.request_id.in_(ids))).all()
    assert sorted(tuple(r) for r in rows) == [("ok", STOP_TOKENS)] * 5
    with pytest.raises(httpx.TransportError):  # Serve's proxy is gone
        httpx.get(f"{platform.url}/v1/models", timeout=5)

