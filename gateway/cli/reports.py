"""`platform invoice` and `platform report`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from billing.migrate import open_database
from gateway.cli.args import UNTIL_HELP, date_arg
from gateway.settings import Settings

REPORT_FORMATS = ("csv", "json", "parquet")
REPORT_KINDS = ("usage", "gpu", "margin")


def register(subparsers: Any) -> None:
    inv = subparsers.add_parser("invoice", help="a tenant's invoice for one month")
    inv.add_argument("--tenant", required=True)
    inv.add_argument("--month", required=True, help="YYYY-MM (UTC)")
    inv.add_argument("--format", choices=("csv", "json", "html"), default="csv")
    inv.add_argument("-o", "--output", type=Path, help="write to FILE instead of stdout")
    inv.set_defaults(func=cmd_invoice)

    rep = subparsers.add_parser("report", help="cost per tenant, day and model (revenue, GPU cost, margin)")
    rep.add_argument("--since", type=date_arg, help="YYYY-MM-DD (inclusive, UTC)")
    rep.add_argument("--until", type=date_arg, help=UNTIL_HELP)
    rep.add_argument("--format", choices=REPORT_FORMATS, required=True)
    rep.add_argument("--kind", choices=REPORT_KINDS, default="usage",
                     help="usage: per tenant × day × model with GPU cost and margin (default); "
                          "gpu: per model alive/busy hours and idle rate; margin: per tenant")
    rep.add_argument("-o", "--output", type=Path,
                     help="write to FILE instead of stdout (parquet: needed on a terminal)")
    rep.set_defaults(func=cmd_report)


def _write(data: bytes, output: Path | None) -> None:
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        output.write_bytes(data)


def cmd_invoice(args: argparse.Namespace, settings: Settings) -> int:
    from billing.invoice import build_invoice
    from billing.invoice_render import render

    engine = open_database(settings.db_url)
    try:
        text = render(build_invoice(engine, args.tenant, args.month), args.format)
    finally:
        engine.dispose()
    _write(text.encode("utf-8"), args.output)
    return 0


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    import pandas as pd

    from billing import reports
    from billing.money import amount_text
    from gateway.cli.output import is_money

    if args.format == "parquet" and args.output is None and sys.stdout.isatty():
        raise ValueError("--format parquet writes binary: give -o FILE (or redirect stdout)")
    build = {"usage": reports.cost_report, "gpu": reports.gpu_by_model, "margin": reports.margin_by_tenant}
    engine = open_database(settings.db_url)
    try:
        frame = build[args.kind](engine, args.since, args.until)
    finally:
        engine.dispose()
    if args.format in ("csv", "json"):
        text = frame.copy()
        for c in text.columns:  # money as exact decimal text ("0.30"), never a float
            if is_money(c):
                text[c] = [None if pd.isna(v) else amount_text(v) for v in text[c]]
        if args.format == "csv":
            data = text.to_csv(index=False).encode("utf-8")
        else:
            data = (text.to_json(orient="records", double_precision=10) + "\n").encode("utf-8")
    else:  # Parquet: money as exact decimals (Arrow decimal128)
        import io

        buf = io.BytesIO()
        frame.to_parquet(buf, index=False)
        data = buf.getvalue()
    _write(data, args.output)
    return 0
