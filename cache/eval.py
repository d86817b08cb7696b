"""`platform cache eval --pairs FILE [--max-false-hit-rate D] [--json]`: hit and false-hit rates of the shipped cache
at a false-hit bound δ.

FILE is JSONL of {"a", "b", "duplicate"}, or a JSON list of {"text_a", "text_b", "label"} (qqp_pairs.json's shape).
Every `a` goes into an empty cache (its own namespace of one in-memory cache, which is the same thing) and `b` is
looked up at δ; a hit on a duplicate counts toward hit_rate, a hit on a non-duplicate toward false_hit_rate. Entries
learn nothing here (each is looked up once).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cache.bounds import DEFAULT_MAX_FALSE_HIT_RATE, OFFERED, offered_text
from cache.namespace import Namespace


def read_pairs(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
        if not all(isinstance(r, dict) and {"text_a", "text_b", "label"} <= r.keys() for r in rows):
            raise ValueError(f"{path}: a JSON list needs text_a, text_b and label in each item")
        return [{"a": r["text_a"], "b": r["text_b"], "duplicate": bool(r["label"])} for r in rows]
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not {"a", "b", "duplicate"} <= row.keys():
            raise ValueError(f"{path}:{n}: each line needs a, b and duplicate")
        pairs.append(row)
    return pairs


def evaluate(pairs: list[dict[str, Any]], cache: Any | None = None,
             max_false_hit_rate: float = DEFAULT_MAX_FALSE_HIT_RATE,
             embeddings: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """`embeddings`: the a and b prompts' vectors when the caller has them already."""
    from cache.semantic_cache import SemanticCache

    cache = SemanticCache(None, learn=False) if cache is None else cache
    if embeddings is None:
        embeddings = (cache.embedder.encode([str(p["a"]) for p in pairs]),
                      cache.embedder.encode([str(p["b"]) for p in pairs]))
    emb_a, emb_b = embeddings
    dup_hits = dup = false_hits = nondup = 0
    for i, p in enumerate(pairs):
        ns = Namespace(tenant="eval", key=f"pair-{i}")
        cache.store(ns, str(p["a"]), "answer", {}, embedding=emb_a[i])
        hit = cache.lookup(ns, str(p["b"]), embedding=emb_b[i], max_false_hit_rate=max_false_hit_rate) is not None
        if p["duplicate"]:
            dup += 1
            dup_hits += hit
        else:
            nondup += 1
            false_hits += hit
    return {
        "pairs": len(pairs),
        "max_false_hit_rate": max_false_hit_rate,
        "threshold": round(cache.bounds.at(max_false_hit_rate).threshold, 6),
        "hit_rate": round(dup_hits / dup, 4) if dup else None,  # None: the file has no pair of that kind
        "false_hit_rate": round(false_hits / nondup, 4) if nondup else None,
        "false_hits": false_hits,
        "duplicates": dup,
        "non_duplicates": nondup,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="platform cache eval", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        pairs = read_pairs(args.pairs)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = evaluate(pairs, max_false_hit_rate=args.max_false_hit_rate)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pairs           {result['pairs']}")
        print(f"bound (δ)       {result['max_false_hit_rate']:.2%}  (verifier threshold {result['threshold']:.4f})")
        print(f"hit rate        {percent(result['hit_rate'])}  (duplicates served from the cache: "
              f"{result['duplicates']} in the file)")
        print(f"false-hit rate  {percent(result['false_hit_rate'])}  (different questions served a cached answer: "
              f"{result['false_hits']} of {result['non_duplicates']})")
    return 0


def percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.2%}"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pairs", type=Path, required=True,
                    help='JSONL of {"a", "b", "duplicate"} or a JSON list of {"text_a", "text_b", "label"}')
    ap.add_argument("--max-false-hit-rate", type=float, default=DEFAULT_MAX_FALSE_HIT_RATE, choices=OFFERED,
                    metavar="D", help=f"the bound δ to serve at: one of {offered_text()} (default "
                                      f"{DEFAULT_MAX_FALSE_HIT_RATE:g})")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


if __name__ == "__main__":
    sys.exit(main())
