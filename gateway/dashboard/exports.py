"""A view's rows as a CSV or JSON download, streamed row by row. Money is exact text (the views pass
billing.money.amount_text: "0.000123", never a float), other Decimals their exact text, times ISO 8601 UTC, tags a list in JSON and `;`-joined in CSV. In CSV a text cell that a
spreadsheet would run as a formula (it starts with = + - @, a tab or a carriage return) is written with a
leading ' so that a tenant or end-user name stays text (a plain number such as a negative amount is left as
it is); JSON has every value verbatim."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from starlette.responses import Response, StreamingResponse

from gateway.dashboard.render import secure

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")
MEDIA_TYPES = {"csv": "text/csv; charset=utf-8", "json": "application/json"}


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return value


def _csv_cell(value: Any) -> Any:
    value = _plain(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        value = ";".join(str(v) for v in value)
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def _csv_lines(columns: list[str], rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_csv_cell(row.get(c)) for c in columns])
        if out.tell() > 64 * 1024:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()


def _json_lines(columns: list[str], rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    yield "["
    first = True
    for row in rows:
        item = {c: _plain(row.get(c)) for c in columns}
        yield ("\n" if first else ",\n") + json.dumps(item, ensure_ascii=False)
        first = False
    yield "\n]\n"


def export(fmt: str, name: str, columns: list[str], rows: Iterable[Mapping[str, Any]]) -> Response:
    """`rows` is read as the response is sent (it may be a generator reading the database in batches)."""
    lines = _csv_lines(columns, rows) if fmt == "csv" else _json_lines(columns, rows)
    response = StreamingResponse(lines, media_type=MEDIA_TYPES[fmt])
    response.headers["Content-Disposition"] = f'attachment; filename="tollgate-{name}.{fmt}"'
    return secure(response)
