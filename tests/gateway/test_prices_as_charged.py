"""Usage is billed at the prices in force when it was recorded: a spec's new prices never re-price last
month's invoice or report (the event and the replica interval keep the prices they were charged at)."""

from __future__ import annotations

import time
from decimal import Decimal

from openai import OpenAI
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.accounts import create_key, create_tenant
from billing.deployments import record_deployments
from billing.invoice import build_invoice
from billing.invoice_render import render
from billing.models import Tenant, UsageEvent
from billing.periods import month_of
from billing.replica_intervals import IntervalRecorder
from billing.reports import cost_report, gpu_by_model
from gateway.specs import ModelSpec
from tests.gateway.conftest import MODEL, make_server

OLD = {"input_per_1m": 100.0, "output_per_1m": 200.0, "gpu_hour": 3.0}
NEW = {"input_per_1m": 700.0, "output_per_1m": 900.0, "gpu_hour": 30.0}


def _priced(spec: ModelSpec, prices: dict[str, float]) -> ModelSpec:
    return spec.model_copy(update={"pricing": spec.pricing.model_copy(update=prices)})


def test_a_price_change_never_alters_a_past_invoice_or_report(db_url, db, backend, spec: ModelSpec):
    old_spec = _priced(spec, OLD)
    server = make_server(db_url, backend, old_spec)  # records the deployment at the old prices
    try:
        create_tenant(db, "acme")
        key = create_key(db, "acme").key
        client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0)
        assert server.gateway.ledger.flush(30)
    finally:
        server.stop()
    with Session(db) as s:
        uid = s.scalar(select(Tenant.uid).where(Tenant.name == "acme"))
    # the replica's time this minute, all of it acme's, priced at the old gpu_hour
    recorder = IntervalRecorder(db, MODEL, "r1", lambda: (1.0, {uid: 1.0}), started_at=time.time() - 2)
    recorder.flush()
    month = month_of(time.time())
    invoice = render(build_invoice(db, "acme", month), "json")
    report = cost_report(db).to_csv(index=False)
    gpu = gpu_by_model(db).to_csv(index=False)
    expected = (answer.usage.prompt_tokens * 100 + answer.usage.completion_tokens * 200) / Decimal(1_000_000)
    lines = build_invoice(db, "acme", month).lines
    assert sum(line.exact_usd for line in lines if line.kind != "gpu_time") == expected
    assert [line.unit_price_per_1m for line in lines if line.kind == "gpu_time"] == [Decimal(3)]

    record_deployments(db, [_priced(spec, NEW).model_dump(mode="json")])  # the spec's prices change

    assert render(build_invoice(db, "acme", month), "json") == invoice
    assert cost_report(db).to_csv(index=False) == report
    assert gpu_by_model(db).to_csv(index=False) == gpu

    # usage recorded after the change is charged the new prices: a line of its own, the old one untouched
    with Session(db) as s, s.begin():
        s.add(UsageEvent(request_id="after", tenant_id=s.scalar(select(Tenant.id).where(Tenant.name == "acme")),
                         model=MODEL, endpoint="chat.completions", status="ok", prompt_tokens=1000,
                         completion_tokens=0, cost_usd=Decimal("0.7"), input_per_1m=Decimal(700),
                         cached_input_per_1m=Decimal(700), output_per_1m=Decimal(900)))
    inputs = [(line.unit_price_per_1m, line.tokens) for line in build_invoice(db, "acme", month).lines
              if line.kind == "input"]
    assert inputs == [(Decimal(100), answer.usage.prompt_tokens), (Decimal(700), 1000)]
