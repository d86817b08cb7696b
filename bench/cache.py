"""Semantic cache benchmarks (results go to BENCHMARKS.md, '## Semantic cache').

    .venv/bin/python bench/cache.py [--sections embedder,index,latency,replay,mock,dev] [--sizes 10000,100000]

- embedder: one prompt's embedding, ONNX Runtime (shipped: two threads while a core is free, else one; and always
           one) against sentence-transformers in PyTorch on one thread.
- index:   exact IndexFlatIP vs HNSW search time and HNSW recall@1 by namespace size (why
           cache/index.py switches at HNSW_THRESHOLD).
- latency: SemanticCache.lookup p50/p99 at 10k and 100k entries in one namespace, verifier
           included; with the query embedding given, end to end (embedding the prompt), and for
           prompts asked again word for word.
- replay:  ShareGPT first turns (shuffled) with repeats: exact, surface-paraphrased and GPTCache
           mock paraphrases; hit rate, unexpected hits and dollars saved. Shipped verifier vs
           plain cosine at 0.8 (GPTCache's default style).
- mock:    GPTCache mock data: each origin alone in a cache, its paraphrase looked up; and all
           origins in one cache, each paraphrase looked up (a hit on the wrong origin is false).
- dev:     paraphrase_dev.jsonl through cache/eval.py, shipped verifier vs cosine 0.8.
QQP sentences embedded once by bench/qqp_embeddings.py serve as realistic cache contents.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/x.py` puts bench/ first on sys.path, where bench/cache.py would shadow
# the cache package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from cache.eval import evaluate  # noqa: E402
from cache.namespace import Namespace  # noqa: E402
from cache.semantic_cache import SemanticCache  # noqa: E402
from cache.verifier import Verifier  # noqa: E402
from bench.qqp_embeddings import DATA, embed_texts, qqp_sentences  # noqa: E402

SEED = 7
# Hypothetical large-model prices for the replay's dollars ($ per 1M tokens); no real output
# lengths are known for these prompts, so each answer is taken to be ANSWER_TOKENS long.
INPUT_PER_1M, OUTPUT_PER_1M, ANSWER_TOKENS = 0.50, 1.50, 250


class CosineOnly:
    """GPTCache-style decision: the nearest entry is a hit when cosine >= threshold."""

    def __init__(self, threshold: float = 0.8) -> None:
        self.threshold = threshold
        self.min_cosine = threshold

    def score_pairs(self, texts_a, texts_b, ea, eb) -> np.ndarray:
        return np.sum(np.atleast_2d(ea) * np.atleast_2d(eb), axis=1)


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.array(values), q)), 3)


def bench_embedder(sentences: list[str], probes: int = 300) -> dict:
    import torch

    from cache.embedder import Embedder

    torch.set_num_threads(1)  # as shared_embedder() sets it for the gateway
    rng = np.random.default_rng(SEED)
    texts = [sentences[i] for i in rng.choice(len(sentences), probes, replace=False)]
    out, vectors = {}, {}
    for name, backend, threads in (("onnx", "onnx", None), ("onnx_1_thread", "onnx", 1), ("torch", "torch", None)):
        emb = Embedder(backend=backend, threads=threads)
        for t in texts[:10]:  # warm-up
            emb.encode_one(t)
        ms = []
        for t in texts:
            start = time.perf_counter()
            emb.encode_one(t)
            ms.append((time.perf_counter() - start) * 1000)
        vectors[name] = emb.encode(texts)
        out[name] = {"ms_p50": pct(ms, 50), "ms_p99": pct(ms, 99)}
        out[name].update(emb.threading_stats())
        print(f"embedder {name}: {out[name]}", file=sys.stderr, flush=True)
    out["speedup_p50"] = round(out["torch"]["ms_p50"] / out["onnx"]["ms_p50"], 2)
    out["speedup_p50_one_thread"] = round(out["torch"]["ms_p50"] / out["onnx_1_thread"]["ms_p50"], 2)
    out["max_abs_difference"] = float(np.abs(vectors["onnx"] - vectors["torch"]).max())
    return out


def bench_index(vecs: np.ndarray, queries: np.ndarray) -> dict:
    import faiss

    from cache.index import HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH, HNSW_M

    out = {}
    for n in (5_000, 20_000, 50_000, 100_000):
        base = vecs[:n]
        flat = faiss.IndexFlatIP(base.shape[1])
        flat.add(base)
        hnsw = faiss.IndexHNSWFlat(base.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        hnsw.hnsw.efSearch = HNSW_EF_SEARCH
        t = time.perf_counter()
        hnsw.add(base)
        build_s = time.perf_counter() - t
        tf, th, agree = [], [], 0
        for q in queries:
            q = q[None, :]
            t = time.perf_counter()
            _, i_f = flat.search(q, 4)
            tf.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            _, i_h = hnsw.search(q, 4)
            th.append((time.perf_counter() - t) * 1000)
            agree += int(i_f[0, 0] == i_h[0, 0])
        out[n] = {"flat_ms_p50": pct(tf, 50), "flat_ms_p99": pct(tf, 99), "hnsw_ms_p50": pct(th, 50),
                  "hnsw_ms_p99": pct(th, 99), "hnsw_recall_at_1": round(agree / len(queries), 3),
                  "hnsw_build_s": round(build_s, 1)}
        print(f"index n={n}: {out[n]}", file=sys.stderr, flush=True)
    return out


def bench_latency(sentences: list[str], vecs: np.ndarray, pairs: list[dict], sizes: tuple[int, ...]) -> dict:
    lookup = {s: i for i, s in enumerate(sentences)}
    rng = np.random.default_rng(SEED)
    dups = [p for p in pairs if p["label"] == 1]
    rng.shuffle(dups)
    out = {}
    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            cache = SemanticCache(d, max_entries=n + 10)
            ns = Namespace("bench", "one-namespace")
            # Half the probes have their duplicate in the cache (the verifier runs), half not.
            probes = dups[:200]
            stored = [p["text_a"] for p in probes[:100]]
            excluded = {p["text_a"] for p in probes} | {p["text_b"] for p in probes}
            others = [s for s in sentences if s not in excluded][: n - len(stored)]
            contents = stored + others
            idx = [lookup[s] for s in contents]
            t = time.perf_counter()
            for i in range(0, len(contents), 5000):
                cache.store_many(ns, contents[i : i + 5000], ["answer"] * len(contents[i : i + 5000]),
                                 [{"prompt_tokens": 20, "completion_tokens": 200}] * len(contents[i : i + 5000]),
                                 vecs[idx[i : i + 5000]])
            fill_s = time.perf_counter() - t
            queries = [p["text_b"] for p in probes]
            qv = vecs[[lookup[q] for q in queries]]
            given, full, hits = [], [], 0
            for q, v in zip(queries, qv):
                t = time.perf_counter()
                hits += cache.lookup(ns, q, embedding=v) is not None
                given.append((time.perf_counter() - t) * 1000)
            for q in queries[:100]:
                t = time.perf_counter()
                cache.lookup(ns, q)
                full.append((time.perf_counter() - t) * 1000)
            exact = []
            for q in stored:  # a prompt asked again word for word: no embedding, no verifier
                t = time.perf_counter()
                cache.lookup(ns, q)
                exact.append((time.perf_counter() - t) * 1000)
            out[n] = {"entries": len(cache), "approximate_index": cache._indexes[("bench", ns.key)].approximate,
                      "search_verify_ms_p50": pct(given, 50), "search_verify_ms_p99": pct(given, 99),
                      "end_to_end_ms_p50": pct(full, 50), "end_to_end_ms_p99": pct(full, 99),
                      "exact_repeat_ms_p50": pct(exact, 50), "exact_repeat_ms_p99": pct(exact, 99),
                      "fill_s": round(fill_s, 1), "probe_hits": hits}
            cache.close()
        print(f"latency n={n}: {out[n]}", file=sys.stderr, flush=True)
    return out


_SWAPS = [("Can you", "Could you"), ("can you", "could you"), ("Please ", ""), ("please ", ""),
          ("I want", "I would like"), ("Write", "Please write"), ("Explain", "Can you explain"),
          ("What is", "What's"), ("How do I", "How can I"), ("give me", "provide me with")]


def surface_paraphrase(text: str, rng: random.Random) -> str:
    """A deterministic rewording a user might make when asking again (not a semantic change)."""
    out = text
    for old, new in rng.sample(_SWAPS, len(_SWAPS)):
        if old in out:
            out = out.replace(old, new, 1)
            break
    out = re.sub(r"\s+", " ", out).strip()
    if rng.random() < 0.5:
        out = out.rstrip("?.!") + ("?" if text.rstrip().endswith("?") else ".")
    if rng.random() < 0.3:
        out = out[0].lower() + out[1:] if out[:1].isupper() else out[0].upper() + out[1:]
    return out if out != text else out + " Thanks!"


def bench_replay(verifiers: dict, n_unique: int = 600) -> dict:
    rng = random.Random(SEED)
    prompts = [json.loads(line)["prompt"] for line in (DATA / "prompts_sharegpt_en_first_turn.jsonl").read_text().split("\n") if line.strip()]
    prompts = [p for p in dict.fromkeys(prompts) if len(p) < 4000]
    rng.shuffle(prompts)
    mock = json.loads((DATA / "gptcache_mock_data.json").read_text())
    rng.shuffle(mock)
    unique = prompts[:n_unique]
    # Trace: each first ask is a miss by construction; repeats come later in the trace.
    events: list[tuple[str, str | None]] = [(p, None) for p in unique]
    events += [(m["origin"], None) for m in mock[:200]]
    repeats: list[tuple[str, str]] = []
    for p in unique[:150]:
        repeats.append((p, p))  # exact repeat
    for p in unique[150:300]:
        repeats.append((surface_paraphrase(p, rng), p))
    for m in mock[:200]:
        repeats.append((m["similar"], m["origin"]))
    rng.shuffle(events)
    trace = events + repeats
    rng.shuffle(trace)
    # Keep causality: a repeat before its original is moved after it.
    seen_first = {t for t, src in trace if src is None}
    ordered, pending, asked = [], {}, set()
    for text, src in trace:
        if src is not None and src not in asked:
            pending.setdefault(src, []).append((text, src))
            continue
        ordered.append((text, src))
        if src is None:
            asked.add(text)
            ordered.extend(pending.pop(text, []))
    assert not pending and seen_first
    texts = [t for t, _ in ordered]
    from cache.embedder import shared_embedder

    emb = shared_embedder()
    vecs = embed_texts(texts, "replay") if len(texts) else np.zeros((0, emb.dim))
    results = {}
    for name, verifier in verifiers.items():
        cache = SemanticCache(None, verifier=verifier)
        ns = Namespace("replay", "group")
        hits = repeat_hits = unexpected = wrong_answer = 0
        n_repeat = sum(1 for _, s in ordered if s is not None)
        for (text, src), v in zip(ordered, vecs):
            hit = cache.lookup(ns, text, embedding=v)
            if hit is None:
                tokens_in = max(1, len(text) // 4)
                cost = tokens_in * INPUT_PER_1M / 1e6 + ANSWER_TOKENS * OUTPUT_PER_1M / 1e6
                cache.store(ns, text, f"answer to: {text}",
                            {"prompt_tokens": tokens_in, "completion_tokens": ANSWER_TOKENS, "cost_usd": cost},
                            embedding=v)
                continue
            hits += 1
            if src is None:
                unexpected += 1
            else:
                repeat_hits += 1
                wrong_answer += hit.cached_prompt != src
        s = cache.stats("replay")
        results[name] = {"requests": len(ordered), "repeats": n_repeat, "hit_rate": round(hits / len(ordered), 4),
                         "repeat_hit_rate": round(repeat_hits / n_repeat, 4), "unexpected_hits": unexpected,
                         "hits_on_wrong_entry": wrong_answer, "saved_tokens": s.saved_tokens,
                         "saved_dollars": round(s.saved_dollars, 4)}
        print(f"replay {name}: {results[name]}", file=sys.stderr, flush=True)
    return results


def bench_mock(verifiers: dict) -> dict:
    mock = json.loads((DATA / "gptcache_mock_data.json").read_text())
    origins = [m["origin"] for m in mock]
    similars = [m["similar"] for m in mock]
    vo = embed_texts(origins, "mock-origin")
    vs = embed_texts(similars, "mock-similar")
    out = {}
    for name, verifier in verifiers.items():
        alone = SemanticCache(None, verifier=verifier)
        alone_hits = 0
        for i in range(len(mock)):
            ns = Namespace("mock", f"pair-{i}")
            alone.store(ns, origins[i], str(i), embedding=vo[i])
            alone_hits += alone.lookup(ns, similars[i], embedding=vs[i]) is not None
        shared = SemanticCache(None, verifier=verifier)
        ns = Namespace("mock", "all")
        # Some origins repeat in the file: a hit is right when it returns the same origin text.
        shared.store_many(ns, origins, origins, [{}] * len(mock), vo)
        right = wrong = 0
        for i in range(len(mock)):
            hit = shared.lookup(ns, similars[i], embedding=vs[i])
            if hit is not None:
                right += hit.answer == origins[i]
                wrong += hit.answer != origins[i]
        out[name] = {"pairs": len(mock), "hit_rate_alone": round(alone_hits / len(mock), 4),
                     "hit_rate_all_in_one": round(right / len(mock), 4), "wrong_entry_hits_all_in_one": wrong}
        print(f"mock {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def bench_dev(verifiers: dict) -> dict:
    from cache.eval import read_pairs

    pairs = read_pairs(DATA / "paraphrase_dev.jsonl")
    return {name: evaluate(pairs, SemanticCache(None, verifier=v)) for name, v in verifiers.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="embedder,index,latency,replay,mock,dev")
    ap.add_argument("--sizes", default="10000,100000")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    verifiers = {"verifier": Verifier.load(), "cosine_0.8": CosineOnly(0.8)}
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU (shared)"}
    if "embedder" in sections:
        report["embedder"] = bench_embedder(qqp_sentences())
    if sections & {"index", "latency"}:
        sentences = qqp_sentences()
        vecs = embed_texts(sentences, "qqp")
        order = np.random.default_rng(SEED).permutation(len(sentences))
        if "index" in sections:
            report["index"] = bench_index(vecs[order], vecs[order[-300:]])
        if "latency" in sections:
            pairs = json.loads((DATA / "qqp_pairs.json").read_text())
            sizes = tuple(int(s) for s in args.sizes.split(","))
            report["latency"] = bench_latency([sentences[i] for i in order], vecs[order], pairs, sizes)
    if "replay" in sections:
        report["replay"] = bench_replay(verifiers)
    if "mock" in sections:
        report["mock"] = bench_mock(verifiers)
    if "dev" in sections:
        report["dev"] = bench_dev(verifiers)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
