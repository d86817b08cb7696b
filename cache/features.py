"""Pair features for the same-question verifier: embedding interactions plus lexical checks.

Shared by training (bench/train_verifier.py) and serving (cache/verifier.py) so both compute
exactly the same vector.
"""
from __future__ import annotations

import re

import numpy as np

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CAPITAL = re.compile(r"\b[A-Z][a-zA-Z0-9]+\b")

STOPWORDS = frozenset(
    """a an the of to in on for and or is are was were be been being do does did can could would
    should will shall may might must i me my we our you your he she it its they them their this that
    these those what which who whom whose how why when where there here with by from at as about into
    than then so if any some much many most more very just also get got have has had am s t""".split()
)
NEGATIONS = frozenset(
    "not no never none nothing nobody neither nor without cannot can't don't doesn't didn't isn't "
    "aren't wasn't weren't won't wouldn't shouldn't couldn't hasn't haven't hadn't n't".split()
)
QUESTION_WORDS = ("what", "how", "why", "which", "who", "where", "when", "is", "can", "do", "should", "are")

LEXICAL_NAMES = (
    "jaccard_words",
    "jaccard_content",
    "jaccard_char3",
    "uncovered_min",
    "uncovered_max",
    "len_ratio_words",
    "len_ratio_chars",
    "abs_len_diff_log",
    "numbers_differ",
    "numbers_any",
    "capitals_jaccard",
    "capitals_uncovered",
    "negation_differ",
    "qword_same",
    "exact_normalized",
)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def numbers(text: str) -> list[str]:
    return sorted(n.replace(",", "") for n in _NUMBER.findall(text))


def numbers_differ(a: str, b: str) -> bool:
    return numbers(a) != numbers(b)


def _jaccard(x: set[str], y: set[str]) -> float:
    if not x and not y:
        return 1.0
    return len(x & y) / len(x | y)


def _char3(text: str) -> set[str]:
    t = " ".join(words(text))
    return {t[i : i + 3] for i in range(max(len(t) - 2, 1))}


def _capitals(text: str) -> set[str]:
    # Named-entity proxy: capitalised words other than the first word of the sentence.
    found = _CAPITAL.findall(text)
    first = text.split(maxsplit=1)[0] if text.strip() else ""
    return {w.lower() for w in found if w != first}


def _qword(ws: list[str]) -> str:
    for w in ws[:3]:
        if w in QUESTION_WORDS:
            return w
    return ""


def lexical_features(a: str, b: str) -> np.ndarray:
    wa, wb = words(a), words(b)
    sa, sb = set(wa), set(wb)
    ca, cb = sa - STOPWORDS, sb - STOPWORDS
    unc_a = len(ca - cb) / max(len(ca), 1)
    unc_b = len(cb - ca) / max(len(cb), 1)
    la, lb = max(len(wa), 1), max(len(wb), 1)
    caps_a, caps_b = _capitals(a), _capitals(b)
    caps_union = caps_a | caps_b
    na, nb = numbers(a), numbers(b)
    neg_a = sum(w in NEGATIONS or w.endswith("n't") for w in wa)
    neg_b = sum(w in NEGATIONS or w.endswith("n't") for w in wb)
    return np.array(
        [
            _jaccard(sa, sb),
            _jaccard(ca, cb),
            _jaccard(_char3(a), _char3(b)),
            min(unc_a, unc_b),
            max(unc_a, unc_b),
            min(la, lb) / max(la, lb),
            min(len(a), len(b)) / max(len(a), len(b), 1),
            abs(np.log(la / lb)),
            float(na != nb),
            float(bool(na or nb)),
            _jaccard(caps_a, caps_b) if caps_union else 1.0,
            len(caps_a ^ caps_b) / max(len(caps_union), 1),
            float((neg_a > 0) != (neg_b > 0)),
            float(_qword(wa) == _qword(wb)),
            float(wa == wb),
        ],
        dtype=np.float32,
    )


def embedding_features(ea: np.ndarray, eb: np.ndarray) -> np.ndarray:
    """Symmetric interactions of two unit vectors (rows): cosine, |a-b|, a*b. Shape (n, 1+2*dim)."""
    ea = np.atleast_2d(ea)
    eb = np.atleast_2d(eb)
    cos = np.sum(ea * eb, axis=1, keepdims=True)
    return np.concatenate([cos, np.abs(ea - eb), ea * eb], axis=1).astype(np.float32)


def pair_features(
    texts_a: list[str], texts_b: list[str], ea: np.ndarray, eb: np.ndarray
) -> np.ndarray:
    lex = np.stack([lexical_features(a, b) for a, b in zip(texts_a, texts_b)])
    return np.concatenate([embedding_features(ea, eb), lex], axis=1)
