"""How the `platform` command prints rows and DataFrames: an aligned table, or JSON with --json."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from billing.money import dollars


def _json_value(value: Any) -> Any:
    return float(value) if isinstance(value, Decimal) else str(value)


def _cell(value: Any) -> str:
    """Decimal amounts without trailing zeros (5, 0.000123), the rest as str()."""
    return format(value.normalize(), "f") if isinstance(value, Decimal) else str(value)


def print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, default=_json_value))
        return
    if not rows:
        print("none")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_cell(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_cell(r.get(c, "")).ljust(widths[c]) for c in cols))


def print_frame(frame: Any, as_json: bool, empty: str) -> None:
    if as_json:
        print(frame.to_json(orient="records"))
    elif frame.empty:
        print(empty)
    else:
        # dollar columns with the precision they have (to the nano-dollar), not pandas' six decimals
        money = {c: (lambda v: _cell(dollars(float(v)))) for c in frame.columns if str(c).endswith("_usd")}
        print(frame.to_string(index=False, formatters=money))
