from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from billing.accounts import create_key, create_tenant
from billing.db import make_engine
from gateway.app import create_app
from gateway.backends import LocalEngineBackend
from gateway.settings import Settings
from gateway.specs import ModelSpec, load_spec
from tests.billing.conftest import db, db_url  # noqa: F401 - the same fresh-database fixtures as billing's
from tests.billing.dbutil import fresh_database
from tests.gateway.live import LiveServer, start
from tests.gateway.serve_platform import platform  # noqa: F401 - Ray Serve once per session, for every module

SPEC_PATH = Path(__file__).resolve().parents[2] / "platform" / "models" / "smollm2-135m.yaml"
MODEL = "smollm2-135m"
SERVER_ADMIN_KEY = "tga-shared-test-server-admin-key"  # the env-style admin key of the `server` fixture


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the Ray Serve platform (the session's `platform` fixture) run together, at the end, in their
    order (test_serve.py's last test stops the platform): Ray starts when the first needs it, and no other test runs
    beside an idle cluster. Between test_lora_serve.py and test_serve.py, ~10 modules (test_ray_output.py's own Ray
    among them) shared the 2 cores with its raylet, agents and the gateway's registry polling."""
    items.sort(key=lambda item: "platform" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def spec() -> ModelSpec:
    spec = load_spec(SPEC_PATH)
    return spec.model_copy(update={"engine": {**spec.engine, "max_model_len": 1024, "max_num_seqs": 32}})


@pytest.fixture(scope="session")
def backend(spec: ModelSpec) -> Iterator[LocalEngineBackend]:
    """The real engine with the bundled model, loaded once for all gateway tests."""
    b = LocalEngineBackend(spec)
    asyncio.run(b.start())
    yield b
    b.stop()


@pytest.fixture(scope="session")
def shared_db_url(tmp_path_factory) -> Iterator[str]:
    with fresh_database(tmp_path_factory.mktemp("gwdb")) as url:
        yield url


@pytest.fixture(scope="session")
def shared_db(shared_db_url: str) -> Iterator[Engine]:
    engine = make_engine(shared_db_url)
    yield engine
    engine.dispose()


def make_server(db_url: str, backend: LocalEngineBackend, spec: ModelSpec, **settings: object) -> LiveServer:
    settings.setdefault("semantic_cache", False)  # on only where a test is about it (test_answer_reuse.py)
    settings.setdefault("cache_explore", 0.0)  # a would-be hit stays a hit unless a test turns exploration on
    s = Settings(database_url=db_url, key_cache_ttl_s=0.0, **settings)
    return start(create_app(s, make_engine(db_url), {spec.name: backend}, [spec]))


@pytest.fixture(scope="session")
def server(shared_db_url: str, backend: LocalEngineBackend, spec: ModelSpec) -> Iterator[LiveServer]:
    live = make_server(shared_db_url, backend, spec, max_body_bytes=64 * 1024, admin_key=SERVER_ADMIN_KEY)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def tenant_key(shared_db: Engine) -> str:
    create_tenant(shared_db, "acme")
    return create_key(shared_db, "acme", project="search").key
