"""A gateway killed with SIGKILL at any instant, the database down, loses no usage event: every admitted
request was journaled before it ran (billing/admission_journal.py); the next process replays the journal,
completed requests with what their clients were given, the one in flight as `interrupted`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from billing.accounts import create_key, create_tenant
from billing.ledger import Ledger
from billing.ledger_spill import spill_dir_for
from billing.models import UsageEvent
from tests.billing.outage import Outage, outage_of
from tests.gateway.live import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


@pytest.fixture
def outage(db_url: str) -> Iterator[Outage]:
    with outage_of(db_url, busy_timeout_s=0.3) as o:
        yield o


def _start_gateway(url: str, spill: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.gateway.gateway_process", url, str(spill), str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"gateway did not start: {proc.communicate()[0][-3000:]}")


def _chat(base: str, key: str, question: str, stream: bool) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 5,
            "temperature": 0.0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["id"], r.json()["usage"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return chunks[0]["id"], chunks[-1]["usage"]


def test_kill_9_during_a_database_outage_loses_no_usage_event(outage: Outage, db: Engine, tmp_path: Path) -> None:
    create_tenant(db, "acme")
    keys = [create_key(db, "acme").key, create_key(db, "acme", rpm=1000, budget_usd=100.0).key]
    spill = tmp_path / "spill"
    proc, base = _start_gateway(outage.url, spill)
    served: dict[str, dict[str, Any]] = {}
    try:
        for key in keys:  # both keys seen once while the database is up
            rid, usage = _chat(base, key, "Warm up.", stream=False)
            served[rid] = usage
        outage.take_down()
        for i in range(12):
            rid, usage = _chat(base, keys[i % 2], f"Question {i} in the outage.", stream=i % 3 == 0)
            served[rid] = usage
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {keys[1]}"}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            in_flight = json.loads(next(lines)[6:])["id"]
            next(lines)
            os.kill(proc.pid, signal.SIGKILL)  # mid-stream, the database down, events not yet written
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    outage.bring_back()
    restarted = Ledger(db, spill_dir=spill_dir_for(spill, outage.url)).start()  # what the next gateway does
    deadline = time.monotonic() + 30
    wanted = set(served) | {in_flight}
    while time.monotonic() < deadline:
        with db.connect() as conn:
            events = {e.request_id: e for e in conn.execute(select(UsageEvent).where(UsageEvent.request_id.in_(wanted)))}
        if len(events) == len(wanted):
            break
        time.sleep(0.2)
    restarted.close()
    assert set(events) == wanted, f"lost: {sorted(wanted - set(events))}"
    for rid, usage in served.items():
        e = events[rid]
        assert (e.status, e.prompt_tokens, e.completion_tokens) == ("ok", usage["prompt_tokens"],
                                                                     usage["completion_tokens"])
    assert events[in_flight].status == "interrupted"
    assert not list(spill.rglob("journal-*.jsonl")) and not list(spill.rglob("usage-*.jsonl"))
