"""Replay a stream of QQP questions through the semantic cache: static thresholds against learned ones.

    .venv/bin/python bench/cache_replay.py [--lookups 12000] [--deltas 0.01,0.02] [--out docs/benchmarks/cache_replay]

The stream (fixed seed) is drawn from the holdout half of bench/calibrate_cache.py's split: QQP components no model
was trained on and no threshold was calibrated on. A lookup asks a question of a duplicate cluster (questions joined
by QQP's duplicate labels; clusters drawn with Zipf popularity; within its cluster a wording not asked yet, or 20% of
the time any, word-for-word repeats included) 70% of the time, else a question with no duplicate (often the other side of a QQP non-duplicate pair: a hard near miss). The
labels are the feedback oracle, as in vCache's benchmarks: a cached answer is right when its prompt is in the
lookup's cluster. Both caches get every miss stored, and every wrong hit flagged (POST /v1/cache/feedback's path);
the learned cache also gets the oracle's label for each `learning` lookup (standing in for comparing the model's fresh
answer with the cached one). Reports hit and false-hit rates (false hits / lookups) per window of 1,000 lookups and
draws them as an SVG. Runs on CPU in a few minutes (embeddings from bench/qqp_embeddings.py's file cache).
"""
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

SEED = 38
WINDOW = 1000
DUPLICATE_SHARE = 0.7
REPEAT_SHARE = 0.2
ZIPF = 1.1


def clusters(pairs: list[dict]) -> dict[str, int]:
    """Question -> cluster id: questions joined by duplicate labels; every other question alone."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        find(p["text_a"]), find(p["text_b"])
        if p["label"]:
            ra, rb = find(p["text_a"]), find(p["text_b"])
            if ra != rb:
                parent[ra] = rb
    roots = {r: i for i, r in enumerate(sorted({find(q) for q in parent}))}
    return {q: roots[find(q)] for q in parent}


def stream(cluster_of: dict[str, int], n: int, rng: np.random.Generator) -> list[str]:
    members: dict[int, list[str]] = {}
    for q, c in sorted(cluster_of.items()):
        members.setdefault(c, []).append(q)
    groups = [m for m in members.values() if len(m) >= 2]
    alone = [m[0] for m in members.values() if len(m) == 1]
    order = rng.permutation(len(groups))
    weights = 1.0 / np.arange(1, len(groups) + 1) ** ZIPF
    weights /= weights.sum()
    asked: set[str] = set()
    out = []
    for _ in range(n):
        if rng.random() < DUPLICATE_SHARE:
            group = groups[order[rng.choice(len(groups), p=weights)]]
            fresh = [q for q in group if q not in asked]
            # mostly a wording not asked before (a paraphrase), else any (a word-for-word repeat)
            pool = fresh if fresh and rng.random() >= REPEAT_SHARE else group
            out.append(pool[rng.integers(len(pool))])
        else:
            out.append(alone[rng.integers(len(alone))])
        asked.add(out[-1])
    return out


def replay(questions: list[str], vecs: dict[str, np.ndarray], cluster_of: dict[str, int], delta: float,
           learn: bool, embedder, verifier) -> dict:
    from cache.semantic_cache import SemanticCache

    cache = SemanticCache(None, embedder=embedder, verifier=verifier, learn=learn)
    ns = Namespace("replay", "qqp")
    hits = np.zeros(len(questions), bool)
    wrong = np.zeros(len(questions), bool)
    learning = np.zeros(len(questions), bool)
    latencies = []
    for i, q in enumerate(questions):
        t0 = time.perf_counter()
        found = cache.consult(ns, q, vecs[q], max_false_hit_rate=delta)
        latencies.append(time.perf_counter() - t0)
        if found.hit is not None:
            hits[i] = True
            if cluster_of[found.hit.cached_prompt] != cluster_of[q]:
                wrong[i] = True
                cache.label(ns, found.entry_id, found.score, False)  # the client flags it
            continue
        if found.state == "learning":
            learning[i] = True
            same = cluster_of[cache._entries[found.entry_id].prompt] == cluster_of[q]
            cache.label(ns, found.entry_id, found.score, same)
        cache.store(ns, q, f"answer {cluster_of[q]}", {}, embedding=vecs[q])
    cache.close()
    windows = []
    for start in range(0, len(questions), WINDOW):
        h, w = hits[start:start + WINDOW], wrong[start:start + WINDOW]
        windows.append({"start": start, "hit_rate": round(float(h.mean()), 4),
                        "false_hit_rate": round(float(w.mean()), 4)})
    return {"delta": delta, "learned": learn, "hit_rate": round(float(hits.mean()), 4),
            "false_hit_rate": round(float(wrong.mean()), 4), "learning_lookups": int(learning.sum()),
            "max_window_false_hit_rate": max(x["false_hit_rate"] for x in windows),
            "last_window_hit_rate": windows[-1]["hit_rate"],
            "lookup_ms_p50": round(float(np.percentile(latencies, 50)) * 1e3, 3),
            "lookup_ms_p99": round(float(np.percentile(latencies, 99)) * 1e3, 3), "windows": windows}


def chart(runs: list[dict], width: int = 760, height: int = 300) -> str:
    """Hit rate (solid) and false-hit rate (dashed, x10) per window for each run, as plain SVG."""
    colors = {(0.01, False): "#888", (0.01, True): "#1f77b4", (0.02, False): "#bbb", (0.02, True): "#d62728"}
    pad, top = 50, 30
    n = len(runs[0]["windows"])
    x = lambda i: pad + i * (width - 2 * pad) / max(n - 1, 1)  # noqa: E731
    y = lambda v: top + (1 - v) * (height - top - 40)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pad}" y="16" font-size="13">Semantic cache replay (QQP holdout): hit rate (solid) and '
             f'false-hit rate x10 (dashed) per {WINDOW:,} lookups</text>']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{pad - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for k, r in enumerate(runs):
        color = colors.get((r["delta"], r["learned"]), "#2ca02c")
        hit = " ".join(f"{x(i):.1f},{y(w['hit_rate']):.1f}" for i, w in enumerate(r["windows"]))
        false = " ".join(f"{x(i):.1f},{y(min(1.0, 10 * w['false_hit_rate'])):.1f}" for i, w in enumerate(r["windows"]))
        parts.append(f'<polyline points="{hit}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<polyline points="{false}" fill="none" stroke="{color}" stroke-width="1.5" '
                     f'stroke-dasharray="4 3"/>')
        label = f"δ={r['delta']:g} {'learned' if r['learned'] else 'static'}"
        parts.append(f'<text x="{width - pad - 150}" y="{top + 14 + 14 * k}" fill="{color}">{label}</text>')
    parts.append(f'<text x="{width / 2:.0f}" y="{height - 8}" text-anchor="middle">lookups (x{WINDOW:,})</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lookups", type=int, default=12_000)
    ap.add_argument("--deltas", default="0.01,0.02")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "cache_replay")
    args = ap.parse_args(argv)
    from cache.embedder import shared_embedder
    from cache.semantic_cache import load_default_verifier

    t0 = time.time()
    calibrate, holdout, dev = calibration_splits()
    index, table = embeddings_for(calibrate + holdout, dev)
    cluster_of = clusters(holdout)
    questions = stream(cluster_of, args.lookups, np.random.default_rng(SEED))
    vecs = {q: table[index[q]] for q in set(questions)}
    embedder, verifier = shared_embedder(), load_default_verifier()
    runs = []
    for delta in (float(d) for d in args.deltas.split(",")):
        for learn in (False, True):
            runs.append(replay(questions, vecs, cluster_of, delta, learn, embedder, verifier))
            r = runs[-1]
            print(f"δ={delta:g} {'learned' if learn else 'static '}: hit {r['hit_rate']:.3f} (last window "
                  f"{r['last_window_hit_rate']:.3f}), false hits {r['false_hit_rate']:.4f} (worst window "
                  f"{r['max_window_false_hit_rate']:.4f}), learning lookups {r['learning_lookups']}, "
                  f"lookup p99 {r['lookup_ms_p99']} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"lookups": args.lookups, "seed": SEED, "window": WINDOW, "duplicate_share": DUPLICATE_SHARE,
               "repeat_share": REPEAT_SHARE,
               "distinct_questions": len(set(questions)),
               "exact_repeats": int(len(questions) - len(set(questions))), "runs": runs,
               "seconds": round(time.time() - t0, 1)}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    args.out.with_suffix(".svg").write_text(chart(runs))
    print(f"wrote {args.out}.json and .svg in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
