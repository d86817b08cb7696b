"""Decides whether a cached prompt asks the same question as a new one.

A small MLP (or logistic regression) over `cache.features.pair_features`, trained by
bench/train_verifier.py on QQP and shipped as cache/verifier.npz (plain arrays, no pickle).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache.features import pair_features
from cache.guards import different_question

DEFAULT_ARTIFACT = Path(__file__).with_name("verifier.npz")


@dataclass(frozen=True)
class Verdict:
    same: bool
    probability: float
    cosine: float


class Verifier:
    def __init__(
        self,
        layers: list[tuple[np.ndarray, np.ndarray]],
        mean: np.ndarray,
        scale: np.ndarray,
        threshold: float,
        min_cosine: float = 0.5,
        meta: dict | None = None,
    ) -> None:
        self.layers = layers
        self.mean = mean
        self.scale = scale
        self.threshold = threshold
        # Pairs below this cosine are never the same question in QQP; skipping them saves the MLP call.
        self.min_cosine = min_cosine
        self.meta = meta or {}
        self.source: Path | None = None  # the artifact it was loaded from

    @classmethod
    def load(cls, path: Path | str = DEFAULT_ARTIFACT, threshold: float | None = None) -> "Verifier":
        with np.load(path, allow_pickle=False) as z:
            n = int(z["n_layers"])
            layers = [(z[f"w{i}"].astype(np.float32), z[f"b{i}"].astype(np.float32)) for i in range(n)]
            meta = json.loads(str(z["meta"]))
            verifier = cls(
                layers,
                z["mean"].astype(np.float32),
                z["scale"].astype(np.float32),
                float(z["threshold"]) if threshold is None else threshold,
                float(z["min_cosine"]),
                meta,
            )
        verifier.source = Path(path) if threshold is None else None
        return verifier

    def save(self, path: Path | str) -> None:
        arrays: dict[str, np.ndarray] = {}
        for i, (w, b) in enumerate(self.layers):
            arrays[f"w{i}"] = w.astype(np.float16) if w.size > 4096 else w
            arrays[f"b{i}"] = b
        np.savez_compressed(
            path,
            n_layers=np.array(len(self.layers)),
            mean=self.mean,
            scale=self.scale,
            threshold=np.array(self.threshold),
            min_cosine=np.array(self.min_cosine),
            meta=np.array(json.dumps(self.meta)),
            **arrays,
        )

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        h = (features - self.mean) / self.scale
        for i, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return 1.0 / (1.0 + np.exp(-h[:, 0]))

    def score_pairs(
        self, texts_a: list[str], texts_b: list[str], ea: np.ndarray, eb: np.ndarray
    ) -> np.ndarray:
        """Probability that each pair asks the same question; hard rules force 0."""
        probs = self.probabilities(pair_features(texts_a, texts_b, ea, eb))
        cos = np.sum(np.atleast_2d(ea) * np.atleast_2d(eb), axis=1)
        for i, (a, b) in enumerate(zip(texts_a, texts_b)):
            # Words that make it another question: numbers, negation, opposites, units, dates, names (cache/guards.py).
            if cos[i] < self.min_cosine or different_question(a, b) is not None:
                probs[i] = 0.0
        return probs

    def verify(self, query: str, q_emb: np.ndarray, cand: str, c_emb: np.ndarray) -> Verdict:
        cos = float(np.dot(q_emb, c_emb))
        if cos < self.min_cosine:
            return Verdict(False, 0.0, cos)
        p = float(self.score_pairs([query], [cand], q_emb[None, :], c_emb[None, :])[0])
        return Verdict(p >= self.threshold, p, cos)
