"""Lookup latency with bounds, learned thresholds and guards on, at 100k entries in one namespace.

    .venv/bin/python bench/cache_lookup_latency.py [--entries 100000] [--delta 0.01]

Contents: the QQP questions of bench/calibrate_cache.py's split (embedded once, file cache), topped up to --entries
with random unit vectors under made-up texts (search cost does not depend on what the vectors mean). Probes: 200
held-out duplicate pairs, one side stored, the other looked up (half of them with their partner stored). Measures
consult() with the embedding given (search + verifier + guards + per-entry thresholds, noting each hit for
feedback) and end to end (embedding the prompt too)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.calibrate_cache import calibration_splits, embeddings_for  # noqa: E402
from cache.namespace import Namespace  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--delta", type=float, default=0.01)
    args = ap.parse_args(argv)
    from cache.semantic_cache import SemanticCache

    calibrate, holdout, dev = calibration_splits()
    index, vecs = embeddings_for(calibrate + holdout, dev)
    rng = np.random.default_rng(5)
    dups = [p for p in holdout if p["label"] == 1]
    probes = [dups[i] for i in rng.permutation(len(dups))[:200]]
    stored = [p["text_a"] for p in probes[:100]]
    skip = {p["text_a"] for p in probes} | {p["text_b"] for p in probes}
    texts = stored + [t for t in index if t not in skip]
    emb = vecs[[index[t] for t in texts]]
    filler = args.entries - len(texts)
    if filler > 0:
        noise = rng.standard_normal((filler, vecs.shape[1])).astype(np.float32)
        emb = np.concatenate([emb, noise / np.linalg.norm(noise, axis=1, keepdims=True)])
        texts = texts + [f"made-up question number {i}" for i in range(filler)]
    texts, emb = texts[: args.entries], emb[: args.entries]
    cache = SemanticCache(None, max_entries=args.entries + 10)
    ns = Namespace("bench", "one")
    t0 = time.perf_counter()
    for i in range(0, len(texts), 5000):
        cache.store_many(ns, texts[i:i + 5000], ["answer"] * len(texts[i:i + 5000]), [{}] * len(texts[i:i + 5000]),
                         emb[i:i + 5000])
    fill_s = time.perf_counter() - t0
    given, full, states = [], [], {}
    for n, p in enumerate(probes):
        q = p["text_b"]
        t = time.perf_counter()
        found = cache.consult(ns, q, vecs[index[q]], args.delta)
        cache.note_served(f"chatcmpl-{n}", ns, found)
        given.append((time.perf_counter() - t) * 1e3)
        states[found.state] = states.get(found.state, 0) + 1
    for p in probes[:100]:
        t = time.perf_counter()
        cache.consult(ns, p["text_b"] + " ", None, args.delta)  # a new text: embedded, never the exact map
        full.append((time.perf_counter() - t) * 1e3)
    out = {"entries": len(cache), "delta": args.delta, "fill_s": round(fill_s, 1),
           "search_verify_ms_p50": pct(given, 50), "search_verify_ms_p99": pct(given, 99),
           "end_to_end_ms_p50": pct(full, 50), "end_to_end_ms_p99": pct(full, 99), "states": states}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
