"""An Invoice as CSV, JSON or self-contained HTML; the same invoice always renders to the same bytes. Each line
shows its billed amount in cents and, beside it, its exact amount to the nano-dollar (billing.money), so a line
that rounds to 0.00 still says what it was; a unit price says its unit (per 1M tokens, per GPU-hour)."""

from __future__ import annotations

import csv
import html
import io
import json
from typing import Any

from billing.invoice import Invoice, InvoiceLine
from billing.money import amount_text

FORMATS = ("csv", "json", "html")
_KIND_LABEL = {"input": "input tokens", "cached_input": "cached input tokens", "output": "output tokens",
               "cache_hit": "cache hits", "gpu_time": "GPU time"}


def dollars(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}"


def render(invoice: Invoice, fmt: str) -> str:
    if fmt == "csv":
        return to_csv(invoice)
    if fmt == "json":
        return to_json(invoice)
    if fmt == "html":
        return to_html(invoice)
    raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")


def unit_price_key(line: InvoiceLine) -> str:
    """The JSON key of a line's unit price, which names its unit."""
    return "unit_price_per_hour" if line.kind == "gpu_time" else "unit_price_per_1m"


def _line(l: InvoiceLine) -> dict[str, Any]:
    return {"model": l.model, "kind": l.kind, "tokens": l.tokens, "gpu_seconds": str(l.gpu_seconds), "unit": l.unit,
            unit_price_key(l): amount_text(l.unit_price_per_1m), "amount_cents": l.amount_cents,
            "amount": dollars(l.amount_cents), "amount_exact": amount_text(l.exact_usd),
            "savings_cents": l.savings_cents, "savings": dollars(l.savings_cents),
            "savings_exact": amount_text(l.exact_savings_usd)}


def as_dict(invoice: Invoice) -> dict[str, Any]:
    return {
        "number": invoice.number, "tenant": invoice.tenant, "month": invoice.month,
        "period_start": invoice.period_start.isoformat(), "period_end": invoice.period_end.isoformat(),
        "currency": invoice.currency, "rounding": invoice.rounding, "requests": invoice.requests,
        "lines": [_line(l) for l in invoice.lines],
        "total_cents": invoice.total_cents, "total": dollars(invoice.total_cents),
        "total_exact": amount_text(invoice.exact_usd),
        "savings_cents": invoice.savings_cents, "savings": dollars(invoice.savings_cents),
    }


def to_json(invoice: Invoice) -> str:
    return json.dumps(as_dict(invoice), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def to_csv(invoice: Invoice) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["invoice", "tenant", "month", "model", "kind", "tokens", "gpu_seconds", "unit", "unit_price_usd",
                "amount_usd", "savings_usd", "amount_exact_usd", "savings_exact_usd"])
    head = [invoice.number, invoice.tenant, invoice.month]
    for l in invoice.lines:
        w.writerow(head + [l.model, l.kind, l.tokens, str(l.gpu_seconds), l.unit, amount_text(l.unit_price_per_1m),
                           dollars(l.amount_cents), dollars(l.savings_cents), amount_text(l.exact_usd),
                           amount_text(l.exact_savings_usd)])
    w.writerow(head + ["", "total", "", "", "", "", dollars(invoice.total_cents), dollars(invoice.savings_cents),
                       amount_text(invoice.exact_usd), amount_text(sum(l.exact_savings_usd for l in invoice.lines))])
    return out.getvalue()


_STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
          "th,td{padding:.3em .8em;border-bottom:1px solid #ddd}td.n,th.n{text-align:right}"
          "tfoot td{font-weight:bold;border-top:2px solid #222}.note{color:#666;font-size:.9em}")


def _quantity(line: InvoiceLine) -> str:
    return f"{line.gpu_seconds:,} GPU-seconds" if line.kind == "gpu_time" else f"{line.tokens:,} tokens"


def to_html(invoice: Invoice) -> str:
    e = html.escape
    cur = e(invoice.currency)
    rows = "".join(
        f"<tr><td>{e(l.model)}</td><td>{_KIND_LABEL[l.kind]}</td><td class=n>{_quantity(l)}</td>"
        f"<td class=n>{amount_text(l.unit_price_per_1m)} per {l.unit}</td>"
        f"<td class=n>{amount_text(l.exact_usd)}</td><td class=n>{dollars(l.amount_cents)}</td>"
        f"<td class=n>{dollars(l.savings_cents) if l.savings_cents else ''}</td></tr>\n"
        for l in invoice.lines)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>Invoice {e(invoice.number)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>Invoice {e(invoice.number)}</h1>\n"
        f"<p>Tenant: <strong>{e(invoice.tenant)}</strong><br>Period: {invoice.period_start.isoformat()} to "
        f"{invoice.period_end.isoformat()} (exclusive)<br>Requests: {invoice.requests:,}</p>\n"
        f"<table><thead><tr><th>Model</th><th>Item</th><th class=n>Quantity</th><th class=n>Unit price ({cur})</th>"
        f"<th class=n>Exact amount ({cur})</th><th class=n>Amount ({cur})</th><th class=n>Cache savings ({cur})</th>"
        f"</tr></thead>\n<tbody>\n{rows}</tbody>\n"
        f"<tfoot><tr><td colspan=4>Total ({cur})</td><td class=n>{amount_text(invoice.exact_usd)}</td>"
        f"<td class=n>{dollars(invoice.total_cents)}</td><td class=n>{dollars(invoice.savings_cents)}</td></tr></tfoot>"
        "</table>\n"
        f"<p class=note>Amounts are billed in cents; the exact amount is each line's before rounding, to the "
        f"nano-dollar. Rounding: {e(invoice.rounding)}.</p>\n</body></html>\n"
    )
