"""How the `platform` command prints rows and DataFrames: an aligned table, or JSON with --json.

Money (every `*_usd` column) is exact decimal text in both, never a float: "0.30", "0.000123" (at least
cents, as many decimals as the amount has, to the nano-dollar). Other Decimals are their exact text. A
missing value is JSON null and "(none)" in a table, so a name such as "NaN" or "None" stays itself; an empty
string is "" in JSON and `""` in a table (a blank cell would read as a missing column)."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

from billing.money import amount_text

MISSING = "(none)"
EMPTY = '""'


def is_money(column: Any) -> bool:
    return str(column).endswith("_usd")


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def plain(column: Any, value: Any) -> Any:
    """A JSON-ready value: money and other Decimals as exact text, numpy scalars as Python ones."""
    if _missing(value):
        return None
    if isinstance(value, Decimal) or (is_money(column) and isinstance(value, (int, float))):
        return amount_text(value) if is_money(column) else format(value, "f")
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalar
        return value.item()
    if isinstance(value, (str, int, float, bool, list, dict)):
        return value
    return str(value)


def _cell(column: Any, value: Any) -> str:
    value = plain(column, value)
    if isinstance(value, float):
        return format(value, ".6g")  # hours, shares: six significant digits in a table (JSON has them all)
    if value is None:
        return MISSING
    return EMPTY if value == "" else str(value)


def print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{k: plain(k, v) for k, v in r.items()} for r in rows], ensure_ascii=False))
        return
    if not rows:
        print("none")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_cell(c, r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_cell(c, r.get(c)).ljust(widths[c]) for c in cols))


def print_frame(frame: Any, as_json: bool, empty: str) -> None:
    if not as_json and frame.empty:
        print(empty)
        return
    print_rows([dict(zip(frame.columns, values)) for values in frame.itertuples(index=False, name=None)], as_json)
