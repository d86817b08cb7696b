"""The dashboard's spend views over HTTP, against tests/gateway/dashboard_seed.py's events: the overview's
spend per day stacked by tenant and by model, usage per key / end user / tag, budgets with the
reservations in flight, GPU seconds per tenant, cache savings, the request log and its filters, and
invoice lines linked to the events behind them. Every number is checked against sums over the seeded
events; every view's CSV (read with the csv module) and JSON (read with json) exports carry the same
rows. Filter values are data: markup and SQL in names, LIKE wildcards, NUL and over-long values."""

from __future__ import annotations

import csv
import html
import io
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any
from pathlib import Path
from urllib.parse import parse_qsl

import httpx
import pytest
from markupsafe import escape
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.invoice import build_invoice
from billing.invoice_render import render
from billing.models import Tenant, UsageEvent
from billing.money import amount_text, dollars, usd
from billing.spend_series import spend_by_day
from gateway.cli import main as cli_main
from tests.billing.dbutil import fresh_database
from tests.gateway.dashboard_seed import (ALERT_AT, BIG, BIG_PRICING, DROP, EVIL_TENANT, EVIL_USER, FORMULA_USER,
                                          IN_FLIGHT, INTERVALS, KEYS, MODEL, SCOPED, SEEDED, TENANTS, Seed, created_at,
                                          this_month, today)
from tests.gateway.test_dashboard import Dashboard, _serve, signed_in_client

PRICES = {MODEL: {"input_per_1m": 0.05, "output_per_1m": 0.10}, BIG: BIG_PRICING}  # the seeded deployments
BAD_MONEY = re.compile(r"\$0\.0000(?![0-9])")  # a sub-cent amount shown without its digits


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    with fresh_database(tmp_path_factory.mktemp("viewsdb")) as url:
        yield from _serve(url)


@pytest.fixture(scope="module")
def client(dashboard: Dashboard) -> Iterator[httpx.Client]:
    c = signed_in_client(dashboard)
    yield c
    c.close()


def exported(client: httpx.Client, path: str, fmt: str, **params: Any) -> list[dict[str, Any]]:
    path, _, query = path.partition("?")  # a link from a page: its filters, and these
    r = client.get(path, params={**dict(parse_qsl(query, keep_blank_values=True)), **params, "format": fmt})
    assert r.status_code == 200, r.text
    assert r.headers["content-disposition"].startswith("attachment;")
    assert r.headers["cache-control"] == "no-store"
    if fmt == "json":
        assert r.headers["content-type"] == "application/json"
        return r.json()
    assert r.headers["content-type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(r.text)))


def both(client: httpx.Client, path: str, **params: Any) -> list[dict[str, Any]]:
    """The JSON export's rows, after checking that the CSV export has the same ones."""
    rows = exported(client, path, "json", **params)
    as_text = [{k: _csv_text(v) for k, v in row.items()} for row in rows]
    assert exported(client, path, "csv", **params) == as_text
    return rows


def _csv_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ";".join(value)
    text = str(value)
    return "'" + text if text.startswith(("=", "+", "-", "@")) and not re.fullmatch(r"-?[0-9.]+", text) else text


def total(events: list[Seed]) -> dict[str, Any]:
    return {"requests": len(events), "prompt_tokens": sum(e.prompt for e in events),
            "completion_tokens": sum(e.completion for e in events), "cost_usd": sum((e.cost_usd for e in events), Decimal(0))}


def grouped(events: list[Seed], keys: Callable[[Seed], list[Any]]) -> dict[Any, dict[str, Any]]:
    groups: dict[Any, list[Seed]] = defaultdict(list)
    for e in events:
        for k in keys(e):
            groups[k].append(e)
    return {k: total(v) for k, v in groups.items()}


def summed(rows: list[dict[str, Any]], key: str | tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {}
    for row in rows:
        group = row[key] if isinstance(key, str) else tuple(row[k] for k in key)
        t = out.setdefault(group, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": Decimal(0)})
        for c in ("requests", "prompt_tokens", "completion_tokens"):
            t[c] += row[c]
        t["cost_usd"] += Decimal(row["cost_usd"])
    return out


def ids(events: list[Seed]) -> set[str]:
    return {f"seed-{SEEDED.index(e)}" for e in events}


def test_overview_stacks_spend_by_tenant_and_by_model(dashboard, client):
    for days in (30, 7):
        shown = [e for e in SEEDED if e.ago < days]
        for by in ("tenant", "model"):
            rows = both(client, "/admin", by=by, days=days)
            assert summed(rows, by) == grouped(shown, lambda e: [getattr(e, by)])
            assert {r["day"] for r in rows} == {e.day.isoformat() for e in shown}
            page = client.get("/admin", params={"by": by, "days": days}).text
            assert re.search(r'id="spend-total">([^<]+)<', page).group(1) == usd(total(shown)["cost_usd"])
            stacks = {(e.day, getattr(e, by)) for e in shown if e.cost_usd}
            assert page.count('class="segment"') == len(stacks)
    # more groups than the chart shows: the rest is one "others" stack with their sums
    last = today()
    series = spend_by_day(dashboard.db, "tenant", last - timedelta(days=29), last, top=2)
    spent = grouped([e for e in SEEDED if e.ago < 30], lambda e: [e.tenant])
    top = sorted(spent, key=lambda t: -spent[t]["cost_usd"])[:2]
    assert series.groups == [*top, None]
    assert series.total(None).cost_usd == sum(v["cost_usd"] for t, v in spent.items() if t not in top)
    assert series.grand_total.requests == sum(v["requests"] for v in spent.values())


def test_usage_per_key_user_and_tag_matches_the_events(dashboard, client):
    key_names = {i: name for name, i in dashboard.keys.items()}
    # end users and tags are a tenant's: one row per (tenant, name)
    expected = {"key": grouped(SEEDED, lambda e: [dashboard.keys[e.key]]),
                "user": grouped(SEEDED, lambda e: [(e.tenant, e.user)]),
                "tag": grouped(SEEDED, lambda e: [(e.tenant, t) for t in e.tags]),
                "tenant": grouped(SEEDED, lambda e: [e.tenant]),
                "model": grouped(SEEDED, lambda e: [e.model])}
    group_of = {"key": "key_id", "user": ("tenant", "group"), "tag": ("tenant", "group")}
    for by, want in expected.items():
        rows = both(client, "/admin/usage", by=by)
        assert len(rows) == len(want), by  # no two rows of one group
        assert summed(rows, group_of.get(by, "group")) == want, by
        assert [Decimal(r["cost_usd"]) for r in rows] == sorted((Decimal(r["cost_usd"]) for r in rows), reverse=True)
        if by == "key":
            assert {r["key_id"]: (r["key_name"], r["tenant"]) for r in rows} == {
                i: (key_names[i], KEYS[key_names[i]][0]) for i in want}
    cached = {r["group"]: r["cached_tokens"] for r in exported(client, "/admin/usage", "json", by="model")}
    assert cached == {m: sum(e.cached for e in SEEDED if e.model == m) for m in (MODEL, BIG)}

    # filters narrow: each alone and all together
    week = (today() - timedelta(days=6)).isoformat()
    cases = [({"tenant": "globex"}, lambda e: e.tenant == "globex"),
             ({"key": dashboard.keys["ci"]}, lambda e: e.key == "ci"),
             ({"model": BIG}, lambda e: e.model == BIG),
             ({"status": "failed"}, lambda e: e.status == "failed"),
             ({"user": "user-0"}, lambda e: e.user == "user-0"),
             ({"tag": "batch"}, lambda e: "batch" in e.tags),
             ({"cache": "hit"}, lambda e: e.cache_hit),
             ({"since": week}, lambda e: e.ago <= 6),
             ({"until": week}, lambda e: e.ago >= 6),
             ({"tenant": "globex", "model": BIG, "status": "ok", "since": week, "cache": "miss"},
              lambda e: e.tenant == "globex" and e.model == BIG and e.ago <= 6 and not e.cache_hit)]
    for params, passes in cases:
        rows = exported(client, "/admin/usage", "json", by="tenant", **params)
        assert summed(rows, "group") == grouped([e for e in SEEDED if passes(e)], lambda e: [e.tenant]), params

    page = client.get("/admin/usage", params={"by": "user"}).text
    assert escape(EVIL_USER) in page and EVIL_USER not in page


@pytest.mark.parametrize(("by", "name"), [("user", "alice"), ("tag", "search")])
def test_an_end_user_or_tag_of_one_name_in_two_tenants_is_two_rows_each_linked_to_its_own_requests(client, by, name):
    def mine(e: Seed) -> bool:
        return e.user == name if by == "user" else name in e.tags

    tenants = {e.tenant for e in SEEDED if mine(e)}
    assert tenants == {"acme", "beta"}
    want = {t: [e for e in SEEDED if e.tenant == t and mine(e)] for t in tenants}
    rows = [r for r in both(client, "/admin/usage", by=by) if r["group"] == name]
    assert {r["tenant"]: (r["requests"], Decimal(r["cost_usd"])) for r in rows} == {
        t: (len(events), total(events)["cost_usd"]) for t, events in want.items()}
    assert len(rows) == 2

    page = client.get("/admin/usage", params={"by": by}).text
    shown = {}
    for row in page.split("<tbody>")[1].split("</tbody>")[0].split("<tr>")[1:]:
        group = html.unescape(re.search(r'<td class="group">([^<]*)</td>', row).group(1))
        tenant = html.unescape(re.search(r'<td class="tenant">([^<]*)</td>', row).group(1))
        link = re.search(r'href="([^"]+)" class="log-link"', row)
        if group == name:
            shown[tenant] = html.unescape(link.group(1))
    assert set(shown) == tenants
    for tenant, link in shown.items():
        assert dict(parse_qsl(link.partition("?")[2])) == {"tenant": tenant, by: name}
        assert {r["request_id"] for r in exported(client, link, "json")} == ids(want[tenant])
    assert f"<title>{name} (beta)</title>" in page and f"<title>{name} (acme)</title>" in page  # the chart's bars too


def _scoped_events(tenant: str, scope: str, name: str) -> list[Seed]:
    """The events an end user's or tag's budget counts: its tenant's, this month."""
    return [e for e in SEEDED if e.tenant == tenant and this_month(e)
            and (e.user == name if scope == "user" else name in e.tags)]


def test_budgets_show_spent_and_the_reservations_in_flight(dashboard, client):
    month = today().strftime("%Y-%m")
    rows = both(client, "/admin/budgets")
    got = {(r["scope"], r["tenant"], r["key_name"] if r["scope"] == "key" else r["name"]): r for r in rows}
    budgets = {("tenant", t, None): b for t, b in TENANTS.items() if b is not None}
    budgets |= {("key", t, k): b for k, (t, _, b) in KEYS.items() if b is not None}
    budgets |= {(scope, t, name): Decimal(b) for t, scope, name, b in SCOPED}
    assert set(got) == set(budgets)
    for (scope, tenant, name), budget in budgets.items():
        if scope in ("user", "tag"):
            events = _scoped_events(tenant, scope, name)
            held = [w for t, _, w, u, tags in IN_FLIGHT if t == tenant and (u == name if scope == "user" else name in tags)]
        else:
            events = [e for e in SEEDED if this_month(e) and (e.tenant == tenant if scope == "tenant" else e.key == name)]
            held = [w for t, k, w, _, _ in IN_FLIGHT if (t if scope == "tenant" else k) == (tenant if scope == "tenant" else name)]
        spent, reserved = sum((e.cost_usd for e in events), Decimal(0)), sum(held, Decimal(0))
        row = got[(scope, tenant, name)]
        assert (row["month"], Decimal(row["budget_usd"]), Decimal(row["spent_usd"]), Decimal(row["reserved_usd"]),
                row["in_flight"]) == (month, dollars(budget), spent, reserved, len(held)), (scope, tenant, name)
        assert Decimal(row["left_usd"]) == dollars(budget) - spent - reserved
        assert row["used_ratio"] == round(float((spent + reserved) / dollars(budget)), 6)
    assert [r["used_ratio"] for r in rows] == sorted((r["used_ratio"] for r in rows), reverse=True)
    # the scoped budgets the in-flight requests hold against, by the real admission: alice's and the search tag's
    assert (got[("user", "acme", "alice")]["in_flight"], got[("tag", "acme", "search")]["in_flight"],
            got[("tag", DROP, "a%")]["reserved_usd"], got[("user", "initech", "alice")]["spent_usd"]) == (
        1, 2, "0.000004", "0.00")
    page = client.get("/admin/budgets").text
    assert "$0.000004" in page and "(2 requests)" in page and escape(DROP) in page
    assert escape(EVIL_USER) in page and EVIL_USER not in page

    # each end-user and tag line links to the request log of its tenant, its user or tag, and the month
    lines = page.split('<tr class="budget"')[1:]
    linked = {}
    for line in lines:
        scope = re.search(r'data-scope="([^"]+)"', line).group(1)
        link = re.search(r'href="([^"]+)" class="log-link"', line)
        if scope in ("tenant", "key"):
            assert link is None
            continue
        name = html.unescape(re.search(r'<strong class="name">([^<]*)</strong>', line).group(1))
        tenant = html.unescape(re.search(r'<span class="hint">\(([^<]*)\)</span>', line).group(1))
        linked[(scope, tenant, name)] = html.unescape(link.group(1))
    assert set(linked) == {(scope, t, name) for t, scope, name, _ in SCOPED}
    for (scope, tenant, name), link in linked.items():
        events = _scoped_events(tenant, scope, name)
        logged = exported(client, link, "json")
        assert {r["request_id"] for r in logged} == ids(events), (scope, tenant, name)
        assert sum((Decimal(r["cost_usd"]) for r in logged), Decimal(0)) == Decimal(got[(scope, tenant, name)]["spent_usd"])
    # a name a spreadsheet would run is text in the CSV, verbatim in JSON
    as_csv = exported(client, "/admin/budgets", "csv")
    assert "'" + FORMULA_USER in {r["name"] for r in as_csv} and FORMULA_USER in {r["name"] for r in rows}
    # another month: its own counters (none), and no requests in flight
    earlier = exported(client, "/admin/budgets", "json", month="2020-01")
    assert {(r["spent_usd"], r["reserved_usd"], r["in_flight"]) for r in earlier} == {("0.00", "0.00", 0)}
    assert len(earlier) == len(rows)


def _gpu_expected(passes: Callable[[str, str, int], bool]) -> dict[str, tuple[Decimal, Decimal]]:
    out: dict[str, tuple[Decimal, Decimal]] = {}
    for model, _, ago, _, _, shares in INTERVALS:
        for s in shares:
            who = s.tenant or "(idle, no tenant)"
            if passes(model, who, ago):
                busy, idle = out.get(who, (Decimal(0), Decimal(0)))
                out[who] = (busy + Decimal(s.busy_s), idle + Decimal(s.idle_s))
    return out


def test_gpu_seconds_per_tenant_add_up_to_the_replicas_time(client):
    cases = [({}, lambda m, t, ago: True), ({"model": BIG}, lambda m, t, ago: m == BIG),
             ({"tenant": "acme"}, lambda m, t, ago: t == "acme"),
             ({"since": today().isoformat()}, lambda m, t, ago: ago == 0)]
    for params, passes in cases:
        rows = both(client, "/admin/gpu", **params)
        assert {r["tenant"]: (Decimal(r["busy_s"]), Decimal(r["idle_s"])) for r in rows} == _gpu_expected(passes)
        assert all(Decimal(r["total_s"]) == Decimal(r["busy_s"]) + Decimal(r["idle_s"]) for r in rows)
        assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-5)
    by_tenant = {r["tenant"]: r for r in exported(client, "/admin/gpu", "json")}
    assert by_tenant["globex"]["gpu_cost_usd"] == "0.208125"  # 249.75 s at $3 per hour, to the nano-dollar
    assert client.get("/admin/gpu").text.count('class="segment"') == 7  # busy and idle of 3 tenants, idle of none


def _savings(events: list[Seed]) -> tuple[int, int, Decimal, int, Decimal]:
    """(requests, semantic-cache hits, what they saved, prefix-cached tokens, what they saved) over one model's
    events, at its list prices."""
    p = PRICES[events[0].model]
    assert {e.model for e in events} == {events[0].model}
    hits = [e for e in events if e.cache_hit]
    semantic = dollars(sum(Decimal(str(p["input_per_1m"])) * e.prompt + Decimal(str(p["output_per_1m"])) * e.completion
                           for e in hits) / 1_000_000)
    cheaper = Decimal(str(p["input_per_1m"])) - Decimal(str(p.get("cached_input_per_1m", p["input_per_1m"])))
    cached = sum(e.cached for e in events if not e.cache_hit)
    return len(events), len(hits), semantic, cached, dollars(cached * cheaper / 1_000_000)


def test_cache_savings_are_exact_at_list_prices(client):
    rows = both(client, "/admin/cache")
    want = {key: _savings(events) for key, events in _by(SEEDED, lambda e: (e.tenant, e.model)).items()}
    got = {(r["tenant"], r["model"]): (r["requests"], r["cache_hits"], Decimal(r["semantic_savings_usd"]),
                                       r["prefix_cached_tokens"], Decimal(r["prefix_savings_usd"])) for r in rows}
    assert got == want and want[("globex", BIG)][2] > 0 and want[("globex", BIG)][4] > 0
    page = client.get("/admin/cache", params={"tenant": "globex"}).text
    saved = want[("globex", BIG)][2] + want[("globex", BIG)][4]
    assert re.search(r'id="saved-total">([^<]+)<', page).group(1) == usd(saved)


def test_overview_shows_the_semantic_cache_and_the_prefix_cache_apart(client):
    month = [e for e in SEEDED if this_month(e)]
    per_model = [_savings(events) for events in _by(month, lambda e: (e.tenant, e.model)).values()]
    requests, hits, semantic, prefix_tokens, prefix = (sum((s[i] for s in per_model), start) for i, start in
                                                       enumerate((0, 0, Decimal(0), 0, Decimal(0))))
    assert hits > 0 and semantic > 0 and prefix_tokens > 0 and prefix > 0
    page = client.get("/admin").text
    shown = {name: re.search(rf'id="{name}">([^<]+)<', page).group(1)
             for name in ("semantic-hit-rate", "semantic-hits", "semantic-saved", "prefix-tokens", "prefix-saved")}
    assert shown == {"semantic-hit-rate": f"{hits / requests * 100:.1f}%", "semantic-hits": f"{hits:,}",
                     "semantic-saved": usd(semantic), "prefix-tokens": f"{prefix_tokens:,}",
                     "prefix-saved": usd(prefix)}
    # each saving sits on its own card (the semantic cache's hits never next to the prefix cache's dollars), and the
    # only dollar figures above the chart are the day's and the month's spend and the two savings, never their sum
    def dollars(html: str) -> list[str]:
        return re.findall(r"\$[0-9][0-9,]*(?:\.[0-9]+)?", html)

    semantic_card = page.split('id="semantic-cache"')[1].split('id="prefix-cache"')[0]
    prefix_card = page.split('id="prefix-cache"')[1].split('<div class="card"')[0]
    assert dollars(semantic_card) == [usd(semantic)] and dollars(prefix_card) == [usd(prefix)]
    spend = [re.search(rf'id="spend-{when}">([^<]+)<', page).group(1) for when in ("today", "month")]
    assert sorted(dollars(page.split('id="spend-chart"')[0])) == sorted([*spend, usd(semantic), usd(prefix)])


def _by(events: list[Seed], key: Callable[[Seed], Any]) -> dict[Any, list[Seed]]:
    out: dict[Any, list[Seed]] = defaultdict(list)
    for e in events:
        out[key(e)].append(e)
    return out


def test_request_log_filters_pages_and_exports_every_row(dashboard, client):
    newest_first = sorted(range(len(SEEDED)), key=lambda i: created_at(i), reverse=True)
    shown = []
    for page in (1, 2):
        text = client.get("/admin/requests", params={"page": page}).text
        shown += re.findall(r'data-request-id="([^"]+)"', text)
    assert shown == [f"seed-{i}" for i in newest_first]
    assert re.search(r'id="total-requests">([^<]+)<', text).group(1) == str(len(SEEDED))
    assert "page 2 of 2" in text and client.get("/admin/requests", params={"page": 3}).status_code == 200

    rows = both(client, "/admin/requests")
    assert [r["request_id"] for r in rows] == [f"seed-{i}" for i in newest_first]
    one = rows[[r["request_id"] for r in rows].index("seed-5")]
    assert (one["end_user"], one["tags"], one["tenant"], one["cost_usd"]) == (FORMULA_USER, ["<b>proj</b>"], EVIL_TENANT,
                                                                             "0.25")
    week = (today() - timedelta(days=6)).isoformat()
    at = created_at([i for i, e in enumerate(SEEDED) if e.ago == 6][1])
    cases = [({"tenant": DROP}, lambda e: e.tenant == DROP),
             ({"tenant": EVIL_TENANT, "user": FORMULA_USER}, lambda e: e.user == FORMULA_USER),
             ({"key": dashboard.keys["initech-app"], "status": "interrupted"},
              lambda e: e.key == "initech-app" and e.status == "interrupted"),
             ({"model": BIG, "cache": "hit"}, lambda e: e.model == BIG and e.cache_hit),
             ({"tag": "a%"}, lambda e: "a%" in e.tags),  # exactly, never as a pattern: not "a_c"
             ({"tag": "a_"}, lambda e: False),
             ({"user": "'; DROP TABLE usage_events; --"}, lambda e: e.user == "'; DROP TABLE usage_events; --"),
             ({"since": week, "until": week}, lambda e: e.ago == 6),
             ({"since": at.strftime("%Y-%m-%dT%H:%M"), "until": (at + timedelta(minutes=1)).isoformat()},
              lambda e: created_at(SEEDED.index(e)) == at)]
    for params, passes in cases:
        want = [e for e in SEEDED if passes(e)]
        assert want or params == {"tag": "a_"}
        got = exported(client, "/admin/requests", "json", **params)
        assert {r["request_id"] for r in got} == ids(want), params
        text = client.get("/admin/requests", params=params).text
        assert re.search(r'id="total-cost">([^<]+)<', text).group(1) == usd(total(want)["cost_usd"]), params
        assert re.search(r'id="total-prompt">([^<]+)<', text).group(1) == f"{total(want)['prompt_tokens']:,}"


def test_invoice_lines_link_to_the_events_behind_them(dashboard, client):
    page = client.get("/admin/invoices", params={"tenant": "globex"}).text
    invoice = client.get("/admin/invoices", params={"tenant": "globex", "format": "json"}).json()
    assert invoice["tenant"] == "globex" and invoice["month"] == today().strftime("%Y-%m")
    lines = [(re.search(r'data-kind="([^"]+)" data-model="([^"]+)"', row).groups(),
              re.search(r'href="([^"]+)" class="events-link"', row).group(1),
              (re.search(r'href="([^"]+)" class="gpu-link"', row) or [None, None])[1])
             for row in page.split('<tr class="invoice-line"')[1:]]
    lines = [(kind, model, events, gpu) for (kind, model), events, gpu in lines]
    assert [(k, m) for k, m, _, _ in lines] == [(line["kind"], line["model"]) for line in invoice["lines"]]
    assert {k for k, _, _, _ in lines} == {"input", "cached_input", "output", "cache_hit", "gpu_time"}
    assert [k for k, _, _, gpu in lines if gpu] == ["gpu_time"]
    month = [e for e in SEEDED if e.tenant == "globex" and this_month(e)]
    for (kind, model, events_link, gpu_link), line in zip(lines, invoice["lines"]):
        behind = [e for e in month if e.model == model and e.cache_hit == (kind == "cache_hit")]
        rows = exported(client, html.unescape(events_link), "json")
        assert {r["request_id"] for r in rows} == ids(behind), kind
        tokens = {"input": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
                  "cached_input": sum(r["cached_tokens"] for r in rows),
                  "output": sum(r["completion_tokens"] for r in rows),
                  "cache_hit": sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows), "gpu_time": 0}[kind]
        assert line["tokens"] == tokens, kind
        if kind == "gpu_time":
            gpu = exported(client, html.unescape(gpu_link), "json")
            assert [(r["tenant"], r["total_s"]) for r in gpu] == [("globex", line["gpu_seconds"])] == [
                ("globex", "249.750000")]
    csv_lines = list(csv.DictReader(io.StringIO(client.get("/admin/invoices", params={
        "tenant": "globex", "format": "csv"}).text)))
    assert [(r["model"], r["kind"]) for r in csv_lines][:-1] == [(x["model"], x["kind"]) for x in invoice["lines"]]


def _invoice_exact(tenant: str) -> dict[tuple[str, str], tuple[Decimal, Decimal]]:
    """(model, kind) → (unit price, exact amount) of the tenant's invoice this month, from the seed's events, prices
    and replica intervals."""
    month = [e for e in SEEDED if e.tenant == tenant and this_month(e)]
    out = {}
    for model, events in _by(month, lambda e: e.model).items():
        p = {k: Decimal(str(v)) for k, v in PRICES[model].items()}
        run = [e for e in events if not e.cache_hit]
        for kind, tokens, price in (("input", sum(e.prompt - e.cached for e in run), p["input_per_1m"]),
                                    ("cached_input", sum(e.cached for e in run), p.get("cached_input_per_1m")),
                                    ("output", sum(e.completion for e in run), p["output_per_1m"]),
                                    ("cache_hit", sum(e.prompt + e.completion for e in events if e.cache_hit), 0)):
            if tokens:
                out[(model, kind)] = (Decimal(price), dollars(tokens * price / 1_000_000))
    seconds = sum(Decimal(s.busy_s) + Decimal(s.idle_s) for model, _, _, _, _, shares in INTERVALS if model == BIG
                  for s in shares if s.tenant == tenant)
    if seconds:
        hourly = Decimal(str(BIG_PRICING["gpu_hour"]))
        out[(BIG, "gpu_time")] = (hourly, dollars(seconds * hourly / 3600))
    return out


@pytest.mark.parametrize("tenant", ["globex", DROP])
def test_invoice_lines_show_their_exact_amounts_beside_the_cents(dashboard, client, tenant):
    want = _invoice_exact(tenant)
    invoice = client.get("/admin/invoices", params={"tenant": tenant, "format": "json"}).json()
    got = {}
    for line in invoice["lines"]:
        per_hour = line["kind"] == "gpu_time"  # a GPU line's price is per hour, and its key says so
        assert (line["unit"], "unit_price_per_hour" in line, "unit_price_per_1m" in line) == (
            ("GPU-hour", True, False) if per_hour else ("1M tokens", False, True)), line
        got[(line["model"], line["kind"])] = (Decimal(line["unit_price_per_hour" if per_hour else "unit_price_per_1m"]),
                                              Decimal(line["amount_exact"]))
        assert line["amount_exact"] == amount_text(Decimal(line["amount_exact"]))  # money's text: "0.0004", not 4E-4
    assert got == want
    assert Decimal(invoice["total_exact"]) == sum(a for _, a in want.values())
    assert abs(Decimal(invoice["total_exact"]) - Decimal(invoice["total"])) <= Decimal("0.005")
    if tenant == DROP:  # lines that round to no cents at all still say what they were
        assert invoice["total"] == "0.00" and Decimal(invoice["total_exact"]) > 0
        assert {line["amount"] for line in invoice["lines"]} == {"0.00"}
    else:
        assert want[(BIG, "gpu_time")] == (Decimal(3), Decimal("0.208125"))

    as_csv = list(csv.DictReader(io.StringIO(client.get("/admin/invoices", params={
        "tenant": tenant, "format": "csv"}).text)))
    assert {(r["model"], r["kind"]): Decimal(r["amount_exact_usd"]) for r in as_csv[:-1]} == {
        k: a for k, (_, a) in want.items()}
    assert as_csv[-1]["amount_exact_usd"] == invoice["total_exact"]

    page = client.get("/admin/invoices", params={"tenant": tenant}).text
    shown = {(html.unescape(m), k): html.unescape(x) for k, m, x in re.findall(
        r'data-kind="([^"]+)" data-model="([^"]+)">.*?<td class="num exact">([^<]+)</td>', page, re.DOTALL)}
    assert shown == {k: usd(a) for k, (_, a) in want.items()}
    assert re.search(r'id="invoice-exact">([^<]+)<', page).group(1) == usd(sum(a for _, a in want.values()))

    # the invoice a tenant is sent (`platform invoice --format html`): units in the headers and on each price
    sent = render(build_invoice(dashboard.db, tenant, today().strftime("%Y-%m")), "html")
    assert "<th class=n>Unit price (USD)</th>" in sent and "<th class=n>Exact amount (USD)</th>" in sent
    assert "<th class=n>USD</th>" not in sent
    for (model, kind), (price, amount) in want.items():
        unit = "GPU-hour" if kind == "gpu_time" else "1M tokens"
        assert f"<td class=n>{amount_text(price)} per {unit}</td><td class=n>{amount_text(amount)}</td>" in sent, kind


def test_hostile_values_are_data_and_bad_parameters_are_refused(dashboard, client):
    for name in (DROP, EVIL_TENANT):
        rows = exported(client, "/admin/usage", "json", by="tenant", tenant=name)
        assert [(r["group"], r["requests"]) for r in rows] == [(name, sum(e.tenant == name for e in SEEDED))]
    tagged = exported(client, "/admin/usage", "json", by="tag", tag="a%")  # a LIKE pattern only as text
    assert [(r["group"], r["requests"]) for r in tagged] == [("a%", 1)]
    assert exported(client, "/admin/usage", "json", by="tenant", tenant="%") == []
    text = client.get("/admin/usage", params={"by": "tenant"}).text
    assert "<script>alert" not in text and escape(EVIL_TENANT) in text
    # a name a spreadsheet would run is text in the CSV, verbatim in JSON
    by_user = {r["group"]: r for r in exported(client, "/admin/usage", "csv", by="user")}
    assert "'" + FORMULA_USER in by_user and FORMULA_USER not in by_user
    assert FORMULA_USER in {r["group"] for r in exported(client, "/admin/usage", "json", by="user")}

    refused = [("/admin/usage", {"tenant": ["a", "b"]}, "tenant"), ("/admin/usage", {"colour": "red"}, "colour"),
               ("/admin/usage", {"by": "country"}, "by"), ("/admin/requests", {"status": "done"}, "status"),
               ("/admin/requests", {"key": "1 OR 1=1"}, "key"), ("/admin/requests", {"key": "0"}, "key"),
               ("/admin/requests", {"since": "yesterday"}, "since"), ("/admin/requests", {"tenant": "a\x00b"}, "tenant"),
               ("/admin/requests", {"user": "u" * 201}, "user"),
               ("/admin/requests", {"since": "2026-02-02", "until": "2026-02-01"}, "until"),
               ("/admin/requests", {"page": "-1"}, "page"), ("/admin/requests", {"cache": "maybe"}, "cache"),
               ("/admin", {"days": "31"}, "days"), ("/admin/budgets", {"month": "2026-13"}, "month"),
               ("/admin/invoices", {"tenant": "nobody"}, "tenant"), ("/admin/gpu", {"status": "ok"}, "status"),
               ("/admin/cache", {"format": "xml"}, "format")]
    for path, params, field in refused:
        r = client.get(path, params=params)
        assert r.status_code == 400 and f"{field}:" in r.text and "text/html" in r.headers["content-type"], (path, params)
        if field != "format":
            r = client.get(path, params={**params, "format": "json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, params)
    r = client.get("/admin/requests", params={"page": "2", "format": "csv"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "page"
    with Session(dashboard.db) as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == len(TENANTS)
        assert s.scalar(select(func.count()).select_from(UsageEvent)) == len(SEEDED)


def test_money_is_shown_with_the_precision_it_has(client):
    pages = [("/admin", {}), ("/admin/usage", {"by": "tenant"}), ("/admin/usage", {"by": "user"}), ("/admin/requests", {}),
             ("/admin/requests", {"tenant": DROP}), ("/admin/budgets", {}), ("/admin/gpu", {}), ("/admin/cache", {}),
             ("/admin/invoices", {"tenant": "globex"}), ("/admin/tenants", {})]
    for path, params in pages:
        text = client.get(path, params=params).text
        assert not BAD_MONEY.search(text), (path, params)
    drop = client.get("/admin/usage", params={"by": "tenant", "tenant": DROP}).text
    assert usd(sum(e.cost_usd for e in SEEDED if e.tenant == DROP)) == "$0.00013" and "$0.00013" in drop
    log = client.get("/admin/requests", params={"tenant": DROP}).text
    assert "$0.000123" in log and "$0.000007" in log


def test_tenants_table_exports(client):
    rows = {r["tenant"]: r for r in both(client, "/admin/tenants")}
    assert set(rows) == set(TENANTS)
    for name, budget in TENANTS.items():
        spent = sum((e.cost_usd for e in SEEDED if e.tenant == name), Decimal(0))
        month = sum((e.cost_usd for e in SEEDED if e.tenant == name and this_month(e)), Decimal(0))
        assert (rows[name]["budget_usd"], Decimal(rows[name]["spend_total_usd"]), Decimal(rows[name]["spend_month_usd"]),
                rows[name]["requests_month"]) == (None if budget is None else amount_text(budget), spent, month,
                                                  sum(e.tenant == name and this_month(e) for e in SEEDED))
    r = client.get("/admin/tenants", params={"tenant": "acme", "format": "json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"


def test_keys_and_models_export_like_every_view(dashboard, client):
    keys = {r["name"]: r for r in both(client, "/admin/keys")}
    for name, (tenant, project, budget) in KEYS.items():
        r = keys[name]
        assert (r["key_id"], r["tenant"], r["project"], r["status"], r["budget_usd"], r["alert_at"]) == (
            dashboard.keys[name], tenant, project, "active", None if budget is None else amount_text(budget),
            ALERT_AT.get(("key", tenant, name))), name
        assert r["key_prefix"].startswith("tg-") and len(r["key_prefix"]) < 16
    text = client.get("/admin/keys", params={"format": "csv"}).text
    assert dashboard.tenant_key not in text and dashboard.tenant_key[:20] not in text  # prefixes, never secrets
    assert "'" + EVIL_TENANT not in text and EVIL_TENANT in text

    models = {r["model"]: r for r in both(client, "/admin/models")}
    assert {m: (r["input_per_1m_usd"], r["cached_input_per_1m_usd"], r["output_per_1m_usd"], r["gpu_hour_usd"])
            for m, r in models.items()} == {MODEL: ("0.05", "0.05", "0.10", "0.00"),  # cached input at the input price
                                            BIG: ("2.00", "0.50", "6.00", "3.00")}
    page = client.get("/admin/models").text
    assert re.findall(r'<td class="num cached-price">(.*?)</td>', page) == [
        "$0.50", '$0.05 <span class="hint">(as input)</span>']
    for path, params, field in [("/admin/keys", {"done": "revoked", "format": "csv"}, "done"),
                                ("/admin/models", {"colour": "red", "format": "json"}, "colour")]:
        r = client.get(path, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, params)
    r = client.get("/admin/models", params={"format": "xml"})
    assert r.status_code == 400 and "format: expected one of html, csv, json" in r.text
    assert client.get("/admin/keys", params={"done": "nonsense"}).status_code == 400
    assert "Key revoked." in client.get("/admin/keys", params={"done": "revoked"}).text


def test_soft_budget_alerts_are_shown_where_budgets_are(dashboard, client):
    rows = both(client, "/admin/budgets")
    got = {(r["scope"], r["tenant"], r["key_name"] if r["scope"] == "key" else r["name"]): r for r in rows}
    for key, row in got.items():
        share = ALERT_AT.get(key)
        assert row["alert_at"] == share, key
        assert row["alert_usd"] == (None if share is None else amount_text(
            Decimal(row["budget_usd"]) * Decimal(repr(share)))), key
    assert got[("key", "acme", "ci")]["alert_usd"] == "2.50" and got[("tag", DROP, "a%")]["alert_usd"] == "0.00025"
    page = client.get("/admin/budgets").text
    line = page.split(f'id="budget-key-{dashboard.keys["ci"]}"')[1].split("</tr>")[0]
    assert '<div class="hint alert-at"><span>alert at 50.0%</span> <span>($2.50)</span></div>' in line
    assert line.count('class="alert-tick"') == 1 and 'x1="70.0"' in line  # the tick at half the 140 px meter
    assert page.count('class="alert-tick"') == len(ALERT_AT) + 1  # and one in the legend

    tenants = {r["tenant"]: r["alert_at"] for r in both(client, "/admin/tenants")}
    assert tenants == {t: ALERT_AT.get(("tenant", t, None)) for t in TENANTS}
    assert "(alert at 80.0%: $80.00)" in client.get("/admin/tenants").text
    key_line = client.get("/admin/keys").text.split(f'id="key-{dashboard.keys["ci"]}"')[1].split("</tr>")[0]
    assert '<td class="alert-at">50.0% <span class="hint">($2.50)</span></td>' in key_line


def test_gpu_table_totals_every_column(client):
    rows = exported(client, "/admin/gpu", "json")
    page = client.get("/admin/gpu").text
    foot = page.split('<tr class="gpu-all">')[1].split("</tr>")[0]
    cells = {c: re.search(rf'<td class="num {c}">([^<]+)</td>', foot).group(1)
             for c in ("busy", "idle", "total", "cost")}
    busy, idle = sum(Decimal(r["busy_s"]) for r in rows), sum(Decimal(r["idle_s"]) for r in rows)
    assert (busy, idle) == (Decimal("192.500001"), Decimal("467.499999"))  # the seeded shares, summed
    assert sum(Decimal(r["gpu_cost_usd"]) for r in rows) == Decimal("0.25")  # big-model's 300 s at $3 an hour
    assert cells == {"busy": "192.5 s", "idle": "467.5 s", "total": "660 s", "cost": "$0.25"}  # the ms above 1 s
    assert "100.0%" in foot


def test_the_dashboards_until_and_the_clis_are_both_documented(client, capsys):
    form = client.get("/admin/requests").text
    assert "To (UTC day, included)" in form and "From (UTC day, included)" in form
    dates = re.search(r'<p class="hint dates" id="f-dates">(.*?)</p>', form, re.DOTALL).group(1)
    assert "Both days are included" in dates and "first day <em>not</em> counted" in dates
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "both included" in readme and "`--until` is the\nfirst day not counted" in readme
    for command in ("usage", "report"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        assert "first UTC day NOT counted" in " ".join(capsys.readouterr().out.split()), command


def test_the_invoice_page_says_lines_are_billed_at_the_prices_charged(dashboard, client):
    page = client.get("/admin/invoices", params={"tenant": "globex"}).text
    assert "current list prices" not in page
    assert "billed at the prices its requests were charged" in page
