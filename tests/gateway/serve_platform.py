"""The platform on real Ray Serve for the tests that need one: Ray started once per session (num_cpus=2), Serve's
proxy, a fresh database, SmolLM2 deployed as a model application scaled to zero, and the gateway application.
tests/gateway/conftest.py makes `platform` a session fixture and runs the tests that use it last, together;
test_serve.py stops the platform in its last test, so modules that use it must sort before test_serve.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine

from gateway.settings import Settings
from gateway.specs import ModelSpec, load_spec
from tests.billing.dbutil import fresh_database
from tests.gateway.live import free_port

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"
DOWNSCALE_S = 3.0


def test_spec(name: str = "smollm2-135m", **autoscaling: object) -> ModelSpec:
    spec = load_spec(SPEC_PATH)
    data = spec.model_dump(mode="json")
    data["name"] = name
    data["engine"].update(max_model_len=512, max_num_seqs=8, cpu_kv_cache_gib=0.25)
    data["autoscaling"].update(min_replicas=0, max_replicas=1, target_ongoing_requests=2, upscale_delay_s=0.0,
                               downscale_delay_s=DOWNSCALE_S, look_back_period_s=1.0, metrics_interval_s=0.5)
    data["autoscaling"].update(autoscaling)
    return ModelSpec.model_validate(data)


test_spec.__test__ = False  # type: ignore[attr-defined]


@dataclass
class Platform:
    url: str
    key: str
    db: Engine
    db_url: str
    settings: Settings
    model: str
    tenant_uid: str
    models_dir: Path  # the gateway's settings.models_dir: adapters a test adds may lie under it

    def chat(self, max_tokens: int = 8, stream: bool = False, timeout: float = 120.0, **extra: object) -> httpx.Response:
        # a new question each time: a repeated one could be answered by the semantic cache, not the model
        question = f"Say hello to {uuid.uuid4().hex[:8]}."
        body = {"model": self.model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0.0, "stream": stream, **extra}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {self.key}"})


def wait_until(predicate, timeout: float, what: str, every: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@pytest.fixture(scope="session")
def platform(tmp_path_factory) -> Iterator[Platform]:
    import ray
    from ray import serve

    from billing.accounts import create_key, create_tenant
    from billing.db import make_engine
    from gateway.serving import deploy as ops
    from gateway.serving.gateway_app import deploy_gateway

    with fresh_database(tmp_path_factory.mktemp("serve")) as db_url:
        db = make_engine(db_url)
        # a cluster of its own ("local"), never one some other process started on the machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            home = tmp_path_factory.mktemp("serve-home")
            models_dir = tmp_path_factory.mktemp("serve-models")
            # the semantic cache is tested on its own; here every request must reach the model
            settings = Settings(database_url=db_url, home=home, models_dir=models_dir, semantic_cache=False,
                                key_cache_ttl_s=0.0, interval_flush_s=2.0, registry_refresh_s=0.25,
                                cold_start_timeout_s=90.0, retry_after_s=7)
            spec = test_spec()
            ops.deploy_model(db, spec, settings)
            deploy_gateway(settings)
            tenant = create_tenant(db, "acme")
            key = create_key(db, "acme").key
            p = Platform(f"http://127.0.0.1:{port}", key, db, db_url, settings, spec.name, tenant.uid, models_dir)
            wait_until(lambda: lists_model(p), 30, "the gateway to list the model")
            yield p
        finally:
            serve.shutdown()
            ray.shutdown()
            db.dispose()


def lists_model(p: Platform) -> bool:
    try:
        r = httpx.get(f"{p.url}/v1/models", headers={"Authorization": f"Bearer {p.key}"}, timeout=5)
    except httpx.TransportError:
        return False
    return r.status_code == 200 and any(m["id"] == p.model for m in r.json()["data"])
