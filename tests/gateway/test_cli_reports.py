"""`platform invoice` and `platform report` through a parser built here with gateway.cli.reports.register."""

import argparse
import contextlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy.orm import Session

from billing.db import make_engine
from billing.models import GpuShare, ModelDeployment, ReplicaInterval, Tenant, UsageEvent
from gateway.cli.reports import register
from gateway.settings import Settings
from tests.billing.dbutil import fresh_database

EVIL = "a'b\"; DROP TABLE tenants;--"
DAY = datetime(2026, 3, 2, 9, tzinfo=timezone.utc)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db_url(tmp_path):
    with fresh_database(tmp_path) as url:
        engine = make_engine(url)
        with Session(engine) as s:
            t = Tenant(name=EVIL)
            s.add_all([t, ModelDeployment(name="small", spec={}, input_per_1m=1.0, output_per_1m=2.0, gpu_hour=3.6)])
            s.flush()
            s.add(UsageEvent(request_id="r1", tenant_id=t.id, model="small", endpoint="completions", status="ok",
                             prompt_tokens=1_000_000, completion_tokens=500_000, latency_s=2.0, created_at=DAY))
            interval = ReplicaInterval(model="small", replica="a", start=DAY, busy_s=600.0, idle_s=2400.0)
            s.add(interval)
            s.flush()
            s.add(GpuShare(interval_id=interval.id, tenant_uid=t.uid, busy_s=600.0, idle_s=2400.0))
            s.commit()
        engine.dispose()
        yield url


def _run(db_url: str, tmp_path, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="platform")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args, Settings(home=tmp_path, database_url=db_url))


def test_invoice_json_to_file_and_csv_to_stdout(db_url, tmp_path, capsys):
    out = tmp_path / "inv.json"
    assert _run(db_url, tmp_path, ["invoice", "--tenant", EVIL, "--month", "2026-03", "--format", "json",
                                   "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    # input, output and the tenant's 3000 GPU-seconds at 3.60 an hour
    assert data["total"] == "5.00" and [l["amount_cents"] for l in data["lines"]] == [100, 100, 300]
    assert _run(db_url, tmp_path, ["invoice", "--tenant", EVIL, "--month", "2026-03"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(",total,,,,,5.00,0.00,5.00,0.00")  # billed, then exact


def test_invoice_errors_name_the_field(db_url, tmp_path):
    with pytest.raises(ValueError, match="^month:"):
        _run(db_url, tmp_path, ["invoice", "--tenant", EVIL, "--month", "2026-3"])
    with pytest.raises(ValueError, match="^tenant:"):
        _run(db_url, tmp_path, ["invoice", "--tenant", "nobody", "--month", "2026-03"])


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_report_formats_round_trip(db_url, tmp_path, fmt):
    out = tmp_path / f"report.{fmt}"
    assert _run(db_url, tmp_path, ["report", "--since", "2026-03-01", "--until", "2026-04-01", "--format", fmt,
                                   "--output", str(out)]) == 0
    frame = {"csv": pd.read_csv, "json": pd.read_json, "parquet": pd.read_parquet}[fmt](out)
    row = frame.iloc[0]
    assert row["tenant"] == EVIL and row["requests_ok"] == 1
    assert row["revenue_usd"] == pytest.approx(2.0)
    assert row["gpu_cost_usd"] == pytest.approx(3000 / 3600 * 3.6)
    assert row["margin_usd"] == pytest.approx(2.0 - 3.0)


def test_report_gpu_kind_and_bad_date(db_url, tmp_path, capsys):
    assert _run(db_url, tmp_path, ["report", "--kind", "gpu", "--format", "json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["idle_rate"] == pytest.approx(0.8)
    with pytest.raises(SystemExit):
        _run(db_url, tmp_path, ["report", "--since", "March", "--format", "csv"])


def test_parquet_report_to_a_terminal_is_refused_and_goes_to_the_file_given_with_o(db_url, tmp_path):
    """A real terminal (a pty) on stdout: no binary is written to it; `-o FILE` writes the report there."""
    cli = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())",
           "--database-url", db_url, "report", "--format", "parquet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    leader, terminal = os.openpty()
    try:
        done = subprocess.run(cli, stdout=terminal, stderr=subprocess.PIPE, env=env, timeout=120)
        os.close(terminal)
        written = b""
        with contextlib.suppress(OSError):  # the pty reads EIO once it is empty and closed
            while chunk := os.read(leader, 4096):
                written += chunk
    finally:
        os.close(leader)
    assert done.returncode == 2 and written == b""
    assert b"error: --format parquet writes binary: give -o FILE (or redirect stdout)" in done.stderr
    out = tmp_path / "report.parquet"
    assert subprocess.run([*cli, "-o", str(out)], env=env, timeout=120).returncode == 0
    assert pd.read_parquet(out).iloc[0]["tenant"] == EVIL
