"""`platform cache eval --pairs FILE.jsonl [--json]`: hit and false-hit rates of the shipped cache.

Each line is {"a", "b", "duplicate"}. Every `a` goes into an empty cache (its own namespace of one
in-memory cache, which is the same thing) and `b` is looked up; a hit on a duplicate counts toward
hit_rate, a hit on a non-duplicate toward false_hit_rate.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cache.namespace import Namespace


def read_pairs(path: Path) -> list[dict[str, Any]]:
    pairs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not {"a", "b", "duplicate"} <= row.keys():
            raise ValueError(f"{path}:{n}: each line needs a, b and duplicate")
        pairs.append(row)
    return pairs


def evaluate(pairs: list[dict[str, Any]], cache: Any | None = None) -> dict[str, Any]:
    from cache.semantic_cache import SemanticCache

    cache = SemanticCache(None) if cache is None else cache
    emb_a = cache.embedder.encode([str(p["a"]) for p in pairs])
    emb_b = cache.embedder.encode([str(p["b"]) for p in pairs])
    dup_hits = dup = false_hits = nondup = 0
    for i, p in enumerate(pairs):
        ns = Namespace(tenant="eval", key=f"pair-{i}")
        cache.store(ns, str(p["a"]), "answer", {}, embedding=emb_a[i])
        hit = cache.lookup(ns, str(p["b"]), embedding=emb_b[i]) is not None
        if p["duplicate"]:
            dup += 1
            dup_hits += hit
        else:
            nondup += 1
            false_hits += hit
    return {
        "pairs": len(pairs),
        "hit_rate": round(dup_hits / dup, 4) if dup else 0.0,
        "false_hit_rate": round(false_hits / nondup, 4) if nondup else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="platform cache eval", description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=Path, required=True, help='JSONL of {"a", "b", "duplicate"}')
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        pairs = read_pairs(args.pairs)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = evaluate(pairs)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pairs           {result['pairs']}")
        print(f"hit rate        {result['hit_rate']:.2%}  (duplicates served from the cache)")
        print(f"false-hit rate  {result['false_hit_rate']:.2%}  (different questions served a cached answer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
