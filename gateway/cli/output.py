"""How the `platform` command prints rows and DataFrames: an aligned table, or JSON with --json."""

from __future__ import annotations

import json
from typing import Any


def print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    if not rows:
        print("none")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def print_frame(frame: Any, as_json: bool, empty: str) -> None:
    if as_json:
        print(frame.to_json(orient="records"))
    elif frame.empty:
        print(empty)
    else:
        print(frame.to_string(index=False))
