"""Replay a stream of QQP questions through the semantic cache: static thresholds against learned ones.

    .venv/bin/python bench/cache_replay.py [--lookups 10000] [--deltas 0.01,0.02] [--out docs/benchmarks/cache_replay]

The stream (fixed seed) is drawn from the holdout half of bench/calibrate_cache.py's split: QQP components (questions
joined by any labelled pair) no model was trained on and no threshold was calibrated on. Each lookup is one of four
kinds, drawn with fixed shares (a kind with nothing left to ask falls back to `new`; the realised shares are
reported):
- repeat (30%): a question asked before, word for word (any asked one, uniformly);
- paraphrase (20%): a wording not asked yet of a question asked before (same QQP duplicate cluster);
- near miss (15%): a question QQP labels a different question from one asked before (same component, another
  cluster): the lookups a cache must not serve;
- new (35%): a question of a component not asked yet.
The labels are the feedback oracle, as in vCache's benchmarks: a cached answer is right when its prompt is in the
lookup's duplicate cluster. Both caches store every lookup they do not serve, and every wrong hit is flagged
(POST /v1/cache/feedback's path); the learned cache also gets the oracle's label for each `learning` lookup (standing
in for comparing the model's fresh answer with the cached one), exploration included. Reported per window of 1,000
lookups: hit rate over all lookups and over paraphrases alone (word-for-word repeats are served by both caches and
hide the difference), and false hits per lookup; an SVG draws them. First, the ceiling: on the same stream with every
label known in advance, the best any one tenant-wide threshold could do while every window stays within δ (what a
learned threshold would reach with nothing left to learn). CPU, a few minutes (embeddings from
bench/qqp_embeddings.py's file cache).
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
from bench.question_groups import question_groups  # noqa: E402
from cache.namespace import Namespace  # noqa: E402
from cache.pooled import ERROR_WINDOW  # noqa: E402

SEED = 38
WINDOW = 1000
END = 2000  # "by the end of the stream": the last this many lookups
SHARES = {"repeat": 0.30, "paraphrase": 0.20, "near_miss": 0.15, "new": 0.35}
KINDS = tuple(SHARES)


def group_ids(pairs: list[dict], duplicates_only: bool) -> dict[str, int]:
    """Question -> its group's number, in the order of the groups' root questions."""
    root = question_groups(pairs, duplicates_only=duplicates_only)
    ids = {r: i for i, r in enumerate(sorted(set(root.values())))}
    return {q: ids[r] for q, r in root.items()}


def clusters(pairs: list[dict]) -> dict[str, int]:
    return group_ids(pairs, duplicates_only=True)


class Pool:
    """A set to draw from uniformly, deterministically (insertion order plus the generator)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.where: dict[str, int] = {}

    def add(self, x: str) -> None:
        if x not in self.where:
            self.where[x] = len(self.items)
            self.items.append(x)

    def discard(self, x: str) -> None:
        i = self.where.pop(x, None)
        if i is not None:
            last = self.items.pop()
            if i < len(self.items):
                self.items[i] = last
                self.where[last] = i

    def draw(self, rng: np.random.Generator) -> str:
        return self.items[rng.integers(len(self.items))]

    def __len__(self) -> int:
        return len(self.items)


def stream(pairs: list[dict], n: int, rng: np.random.Generator) -> tuple[list[str], list[str], dict[str, int]]:
    """(questions, their kinds, question -> cluster) for n lookups (see the module's docstring)."""
    cluster_of, component_of = clusters(pairs), group_ids(pairs, duplicates_only=False)
    in_component: dict[int, list[str]] = {}
    for q in sorted(cluster_of):
        in_component.setdefault(component_of[q], []).append(q)
    components = list(rng.permutation(sorted(in_component)))
    asked, paraphrases, near_misses = Pool(), Pool(), Pool()
    asked_clusters: set[int] = set()
    questions, kinds = [], []
    for _ in range(n):
        kind = KINDS[rng.choice(len(KINDS), p=list(SHARES.values()))]
        pool = {"repeat": asked, "paraphrase": paraphrases, "near_miss": near_misses}.get(kind)
        if pool is not None and len(pool):
            q = pool.draw(rng)
        else:
            kind, c = "new", components.pop()
            q = in_component[c][rng.integers(len(in_component[c]))]
            for other in in_component[c]:  # the component's other questions are now near misses or paraphrases
                near_misses.add(other)
        questions.append(q)
        kinds.append(kind)
        if q not in asked.where:
            asked.add(q)
            paraphrases.discard(q)
            near_misses.discard(q)
            if cluster_of[q] not in asked_clusters:
                asked_clusters.add(cluster_of[q])
                for other in in_component[component_of[q]]:
                    if cluster_of[other] == cluster_of[q] and other not in asked.where:
                        near_misses.discard(other)
                        paraphrases.add(other)
    return questions, kinds, cluster_of


def rates(hits: np.ndarray, wrong: np.ndarray, kinds: np.ndarray) -> dict:
    paraphrase = kinds == "paraphrase"
    return {"hit_rate": round(float(hits.mean()), 4),
            "paraphrase_hit_rate": round(float(hits[paraphrase].mean()), 4) if paraphrase.any() else None,
            "false_hit_rate": round(float(wrong.mean()), 4), "false_hits": int(wrong.sum())}


def replay(questions: list[str], kinds: list[str], vecs: dict[str, np.ndarray], cluster_of: dict[str, int],
           delta: float, learn: bool, embedder, verifier, error_window: int | None = ERROR_WINDOW) -> dict:
    """`error_window`: the learned cache's bound holds per window of that many lookups, or on average (None)."""
    from cache.semantic_cache import SemanticCache

    cache = SemanticCache(None, embedder=embedder, verifier=verifier, learn=learn, seed=SEED,
                          error_window=error_window)
    ns = Namespace("replay", "qqp")
    n = len(questions)
    hits, wrong, learning, explored = (np.zeros(n, bool) for _ in range(4))
    latencies = []
    for i, q in enumerate(questions):
        t0 = time.perf_counter()
        found = cache.consult(ns, q, vecs[q], max_false_hit_rate=delta)
        latencies.append(time.perf_counter() - t0)
        if found.hit is not None:
            hits[i] = True
            if cluster_of[found.hit.cached_prompt] != cluster_of[q]:
                wrong[i] = True
                cache.note_served(f"replay-{i}", ns, found)  # the client flags it
                cache.flag(ns.tenant, f"replay-{i}")
            continue
        if found.state == "learning":  # the model answers; the oracle says whether the answers agree
            learning[i], explored[i] = True, found.explored
            same = cluster_of[cache._entries[found.entry_id].prompt] == cluster_of[q]
            cache.label(ns, found.entry_id, found.score, same, explored=found.explored)
        cache.store(ns, q, f"answer {cluster_of[q]}", {}, embedding=vecs[q])
    learned = cache.learned_thresholds(ns.tenant).get(delta)
    cache.close()
    k = np.array(kinds)
    windows = [{"start": a, **rates(hits[a:a + WINDOW], wrong[a:a + WINDOW], k[a:a + WINDOW])}
               for a in range(0, n, WINDOW)]
    return {"delta": delta, "learned": learn, "error_window": error_window if learn else None, **rates(hits, wrong, k),
            "end": rates(hits[-END:], wrong[-END:], k[-END:]),
            "by_kind": {kind: round(float(hits[k == kind].mean()), 4) for kind in KINDS if (k == kind).any()},
            "learning_lookups": int(learning.sum()), "explored_lookups": int(explored.sum()),
            "threshold_at_end": None if learned is None else round(learned, 5),
            "max_window_false_hit_rate": max(x["false_hit_rate"] for x in windows),
            "lookup_ms_p50": round(float(np.percentile(latencies, 50)) * 1e3, 3),
            "lookup_ms_p99": round(float(np.percentile(latencies, 99)) * 1e3, 3), "windows": windows}


def best_candidates(questions: list[str], vecs: dict[str, np.ndarray], cluster_of: dict[str, int], verifier,
                    top_k: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each lookup that is not a word-for-word repeat: the verifier's best score over the top_k nearest questions
    asked before (as the cache's lookup takes them), whether that candidate is the same question, and which question it
    is; every question is kept (nothing served), so each lookup sees every earlier one. Repeats get score -1."""
    n = len(questions)
    scores, right, entry = np.full(n, -1.0), np.zeros(n, bool), np.full(n, -1)
    asked: dict[str, int] = {}
    matrix = np.zeros((len(set(questions)), len(next(iter(vecs.values())))), np.float32)
    order: list[str] = []
    for i, q in enumerate(questions):
        if q in asked:
            continue
        if order:
            cos = matrix[: len(order)] @ vecs[q]
            near = np.argsort(-cos)[:top_k]
            near = near[cos[near] >= verifier.min_cosine]
            if len(near):
                probs = verifier.score_pairs([q] * len(near), [order[j] for j in near],
                                             np.repeat(vecs[q][None, :], len(near), 0), matrix[near])
                j = int(near[int(np.argmax(probs))])
                scores[i], right[i], entry[i] = float(np.max(probs)), cluster_of[order[j]] == cluster_of[q], j
        asked[q] = len(order)
        matrix[len(order)] = vecs[q]
        order.append(q)
    return scores, right, entry


def worst_window(wrong: np.ndarray) -> float:
    """The largest share of false hits in any window of WINDOW lookups (the stream cut into consecutive windows)."""
    return max(float(wrong[a:a + WINDOW].mean()) for a in range(0, len(wrong), WINDOW))


def oracle_threshold(scores: np.ndarray, right: np.ndarray, delta: float, calibrated: float, floor: float) -> float:
    """The lowest threshold in [floor, calibrated] (a lookup's score, or `calibrated` itself) at which every window's
    false hits stay <= delta, knowing every lookup's label: lowering a threshold only adds hits, so the search stops
    at the first one that breaks a window."""
    best = calibrated
    for t in np.unique(scores[(scores >= floor) & (scores < calibrated)])[::-1]:
        if worst_window((scores >= t) & ~right) > delta:
            break
        best = float(t)
    return best


def ceiling(questions: list[str], kinds: list[str], vecs: dict[str, np.ndarray], cluster_of: dict[str, int], verifier,
            bounds) -> list[dict]:
    """What any one tenant-wide threshold could do on this stream if it knew every label in advance: for each δ, the
    lowest threshold whose false hits stay <= δ in every window, its hit rate on paraphrases against the calibrated
    threshold's, and how many labels an entry could learn its own threshold from. An upper bound for a threshold
    learned while the stream runs (cache/pooled.py), which must keep a margin for what it has not seen."""
    scores, right, entry = best_candidates(questions, vecs, cluster_of, verifier)
    paraphrase = np.array(kinds) == "paraphrase"

    def at(t: float) -> dict:
        served = scores >= t
        wrong = served & ~right
        return {"threshold": round(float(t), 5), "paraphrase_hit_rate": float(served[paraphrase].mean()),
                "paraphrase_hit_rate_end": float(served[-END:][paraphrase[-END:]].mean()),
                "false_hit_rate": float(wrong.mean()), "max_window_false_hit_rate": worst_window(wrong),
                "windows": [{"start": a, "paraphrase_hit_rate": float(served[a:a + WINDOW][paraphrase[a:a + WINDOW]].mean())
                             if paraphrase[a:a + WINDOW].any() else None,
                             "false_hit_rate": float(wrong[a:a + WINDOW].mean())}
                            for a in range(0, len(scores), WINDOW)]}

    out = []
    for bound in bounds:
        static = at(bound.threshold)
        oracle = at(oracle_threshold(scores, right, bound.max_false_hit_rate, bound.threshold, bound.learning_floor))
        near = entry[(scores >= bound.learning_floor) & (scores < bound.threshold)]  # lookups that would be labelled
        per_entry = np.bincount(near) if len(near) else np.zeros(1, int)
        out.append({"delta": bound.max_false_hit_rate, "static": static, "oracle": oracle,
                    "ratio": round(oracle["paraphrase_hit_rate"] / static["paraphrase_hit_rate"], 3),
                    "ratio_end": round(oracle["paraphrase_hit_rate_end"] / static["paraphrase_hit_rate_end"], 3),
                    "entries_with_labels": {f">={m}": int((per_entry >= m).sum()) for m in (1, 2, 3, 5)}})
    return out


def name(run: dict) -> str:
    if run.get("ceiling"):
        return "ceiling (every label known)"
    if not run["learned"]:
        return "static"
    return "learned" if run["error_window"] else "learned, bound on average"


def chart(runs: list[dict], ceilings: list[dict] = (), width: int = 760, height: int = 320) -> str:
    """Hit rate on paraphrases (solid) and false hits per lookup (dashed, x10) per window for each run, and the
    ceiling's hit rate (dotted), as plain SVG."""
    colors = {(0.01, "static"): "#888", (0.01, "learned"): "#1f77b4", (0.01, "learned, bound on average"): "#17becf",
              (0.02, "static"): "#bbb", (0.02, "learned"): "#d62728", (0.02, "learned, bound on average"): "#ff7f0e",
              (0.01, "ceiling (every label known)"): "#2ca02c", (0.02, "ceiling (every label known)"): "#9467bd"}
    runs = [r for r in runs if (r["delta"], name(r)) in colors]
    runs += [{"delta": c["delta"], "ceiling": True, "windows": c["oracle"]["windows"]} for c in ceilings
             if (c["delta"], "ceiling (every label known)") in colors]
    pad, top = 50, 30
    n = len(runs[0]["windows"])
    x = lambda i: pad + i * (width - 2 * pad) / max(n - 1, 1)  # noqa: E731
    y = lambda v: top + (1 - v) * (height - top - 40)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pad}" y="16" font-size="13">Semantic cache replay (QQP holdout): hit rate on paraphrases (solid) '
             f'and false hits per lookup x10 (dashed), per {WINDOW:,} lookups; ceiling dotted</text>']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{pad - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for k, r in enumerate(runs):
        color = colors[(r["delta"], name(r))]
        hit = " ".join(f"{x(i):.1f},{y(w['paraphrase_hit_rate'] or 0):.1f}" for i, w in enumerate(r["windows"]))
        false = " ".join(f"{x(i):.1f},{y(min(1.0, 10 * w['false_hit_rate'])):.1f}" for i, w in enumerate(r["windows"]))
        if r.get("ceiling"):
            parts.append(f'<polyline points="{hit}" fill="none" stroke="{color}" stroke-width="1.5" '
                         f'stroke-dasharray="1 3"/>')
        else:
            parts.append(f'<polyline points="{hit}" fill="none" stroke="{color}" stroke-width="2"/>')
            parts.append(f'<polyline points="{false}" fill="none" stroke="{color}" stroke-width="1.5" '
                         f'stroke-dasharray="4 3"/>')
        label = f"δ={r['delta']:g} {name(r)}"
        parts.append(f'<text x="{width - pad - 190}" y="{top + 14 + 14 * k}" fill="{color}">{label}</text>')
    parts.append(f'<text x="{width / 2:.0f}" y="{height - 8}" text-anchor="middle">lookups (x{WINDOW:,})</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lookups", type=int, default=10_000)
    ap.add_argument("--deltas", default="0.01,0.02")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "cache_replay")
    args = ap.parse_args(argv)
    from cache.embedder import shared_embedder
    from cache.semantic_cache import load_default_verifier

    t0 = time.time()
    calibrate, holdout, dev = calibration_splits()
    index, table = embeddings_for(calibrate + holdout, dev)
    questions, kinds, cluster_of = stream(holdout, args.lookups, np.random.default_rng(SEED))
    vecs = {q: table[index[q]] for q in set(questions)}
    mix = {kind: round(kinds.count(kind) / len(kinds), 4) for kind in KINDS}
    print(f"{len(questions)} lookups, {len(set(questions))} distinct questions; mix {mix}", flush=True)
    embedder, verifier = shared_embedder(), load_default_verifier()
    from cache.bounds import shipped_bounds

    deltas = [float(d) for d in args.deltas.split(",")]
    limits = ceiling(questions, kinds, vecs, cluster_of, verifier, [shipped_bounds().at(d) for d in deltas])
    for c in limits:
        print(f"δ={c['delta']:g} ceiling (every label known, one threshold, every window <= δ): threshold "
              f"{c['oracle']['threshold']} serves {c['oracle']['paraphrase_hit_rate']:.3f} of paraphrases against "
              f"{c['static']['paraphrase_hit_rate']:.3f} at the calibrated {c['static']['threshold']}: {c['ratio']:.2f}x "
              f"({c['ratio_end']:.2f}x over the last {END:,}); worst window {c['oracle']['max_window_false_hit_rate']:.4f}; "
              f"entries with >=1/2/3/5 labels below the threshold: {list(c['entries_with_labels'].values())}", flush=True)
    runs = []
    for delta in deltas:
        for learn, window in ((False, None), (True, ERROR_WINDOW), (True, None)):
            runs.append(replay(questions, kinds, vecs, cluster_of, delta, learn, embedder, verifier, window))
            r = runs[-1]
            print(f"δ={delta:g} {name(r)}: hit {r['hit_rate']:.3f}, paraphrases "
                  f"{r['paraphrase_hit_rate']:.3f} (last {END:,}: {r['end']['paraphrase_hit_rate']:.3f}), false hits "
                  f"{r['false_hit_rate']:.4f} (worst window {r['max_window_false_hit_rate']:.4f}), learning "
                  f"{r['learning_lookups']} ({r['explored_lookups']} explored), threshold at the end "
                  f"{r['threshold_at_end']}, by kind {r['by_kind']}", flush=True)
        static, learned = runs[-3], runs[-2]
        for key, a, b in (("all lookups", static, learned), ("paraphrases", static, learned),
                          (f"paraphrases, last {END:,}", static["end"], learned["end"])):
            field = "hit_rate" if key == "all lookups" else "paraphrase_hit_rate"
            print(f"  learned / static, {key}: {b[field] / a[field]:.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"lookups": args.lookups, "seed": SEED, "window": WINDOW, "end": END, "shares_asked": SHARES,
               "mix": mix, "distinct_questions": len(set(questions)), "ceiling": limits, "runs": runs,
               "seconds": round(time.time() - t0, 1)}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    args.out.with_suffix(".svg").write_text(chart(runs, limits))
    print(f"wrote {args.out}.json and .svg in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
