"""Prometheus alert rules: promtool check + unit tests (when promtool is installed), every metric the
rules read is one /metrics exports, and the metrics the rules need behave."""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from billing.db import make_engine
from billing.models import SpendCounter, Tenant
from billing.periods import month_of
from gateway.metrics import MAX_TENANT_LABELS, OTHER_TENANT, Metrics
from tests.billing.dbutil import fresh_database

RULES_DIR = Path(__file__).resolve().parents[2] / "platform" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install prometheus)")
EVIL = 'we"ird\\ten\nant\'; DROP TABLE tenants;--'
STATS = {"small": {"kv_cache_usage": 0.25, "busy_seconds": 3.0, "idle_seconds": 9.0, "num_running": 0,
                   "num_waiting": 0}}


@pytest.fixture
def db(tmp_path):
    with fresh_database(tmp_path) as url:
        engine = make_engine(url)
        yield engine
        engine.dispose()


def _samples(metrics: Metrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _metrics(**kw) -> Metrics:
    return Metrics(lambda: STATS, lambda: 0, gpu_memory=lambda: [("0", 95, 100)], **kw)


@needs_promtool
def test_promtool_check_rules():
    subprocess.run([PROMTOOL, "check", "rules", str(RULES_DIR / "alerts.yml")], check=True, capture_output=True)


@needs_promtool
def test_promtool_unit_tests():
    done = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=RULES_DIR, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_required_alerts_exist_and_read_exported_metrics(db):
    groups = yaml.safe_load((RULES_DIR / "alerts.yml").read_text())["groups"]
    rules = {r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert {"TollgateHighP95Latency", "TollgateHighErrorRate", "TollgateGpuMemoryHigh", "TollgateGpuUnderused",
            "TollgateTenantBudget80", "TollgateTenantBudgetExhausted"} <= set(rules)
    m = _metrics()
    m.watch_budgets(db)
    m.requests.labels("small", "completions", "failed").inc()
    m.latency.labels("small").observe(0.1)
    with Session(db) as s:
        s.add(Tenant(name="acme", budget_usd=10.0))
        s.commit()
    exported = set(_samples(m))
    read = {name for expr in rules.values() for name in re.findall(r"\btollgate_[a-z0-9_]+", expr)}
    assert read and read <= exported, read - exported


def test_budget_ratio_from_the_database_with_a_short_cache(db):
    month = month_of(time.time())
    with Session(db) as s:
        evil, free = Tenant(name=EVIL, budget_usd=20.0), Tenant(name="free")
        s.add_all([evil, free, Tenant(name="idle", budget_usd=5.0)])
        s.flush()
        s.add_all([SpendCounter(scope="tenant", scope_id=evil.id, period=month, spent_usd=17.0),
                   SpendCounter(scope="tenant", scope_id=evil.id, period="1999-01", spent_usd=99.0),
                   SpendCounter(scope="tenant", scope_id=free.id, period=month, spent_usd=3.0)])
        s.commit()
    m = _metrics()
    m.watch_budgets(db, ttl_s=3600)
    ratios = {s.labels["tenant"]: s.value for s in _samples(m)["tollgate_tenant_budget_used_ratio"]}
    assert ratios == {EVIL: pytest.approx(0.85), "idle": 0.0}  # no budget, no series
    with Session(db) as s:
        s.query(SpendCounter).filter_by(period=month, spent_usd=17.0).update({"spent_usd": 25.0})
        s.commit()
    cached = {s.labels["tenant"]: s.value for s in _samples(m)["tollgate_tenant_budget_used_ratio"]}
    assert cached[EVIL] == pytest.approx(0.85)
    fresh = _metrics()
    fresh.watch_budgets(db, ttl_s=0)
    assert {s.labels["tenant"]: s.value for s in _samples(fresh)["tollgate_tenant_budget_used_ratio"]}[EVIL] == 1.25


def test_spend_labels_are_bounded_and_cache_hits_tpot_engine_gauges():
    m = _metrics()
    for i in range(MAX_TENANT_LABELS + 5):
        m.add_spend(f"t{i}", 1.0)
    m.add_spend("t0", 2.0)
    spend = {s.labels["tenant"]: s.value for s in _samples(m)["tollgate_tenant_spend_usd_total"]}
    assert len(spend) == MAX_TENANT_LABELS + 1 and spend[OTHER_TENANT] == 5.0 and spend["t0"] == 3.0
    m.cache_hit("small", saved_usd=0.5)
    m.cache_hit("small")
    m.request_done("small", "completions", "ok", 5, 11, 0.0, latency_s=1.1, ttft_s=0.1, queue_s=None)  # 0.1 s/token
    m.request_done("small", "completions", "ok", 5, 11, 0.0, latency_s=1.0, ttft_s=None, queue_s=None)  # no TTFT
    m.request_done("small", "completions", "ok", 5, 11, 0.0, latency_s=1.0, ttft_s=0.1, queue_s=None, tpot=False)
    got = _samples(m)
    assert got["tollgate_cache_hits_total"][0].value == 2
    assert got["tollgate_cache_saved_usd_total"][0].value == 0.5
    assert got["tollgate_time_per_output_token_seconds_count"][0].value == 1
    assert got["tollgate_time_per_output_token_seconds_sum"][0].value == pytest.approx(0.1)
    assert got["tollgate_requests_total"][0].value == 3 and got["tollgate_tokens_total"][1].value == 33
    assert got["tollgate_kv_cache_usage_perc"][0].value == 0.25
    assert got["tollgate_model_busy_seconds_total"][0].value == 3.0
    assert got["tollgate_model_engine_busy"][0].value == 0.0
