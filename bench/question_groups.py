"""Groups of QQP questions: the connected parts of the graph whose edges are labelled pairs."""
from __future__ import annotations

from typing import Callable


def question_groups(pairs: list[dict], key: Callable[[str], str] = str,
                    duplicates_only: bool = False) -> dict[str, str]:
    """Question (as `key` writes it) -> the root question of its group: questions joined by any pair (components)
    or, with `duplicates_only`, by duplicate-labelled pairs alone (clusters)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        ra, rb = find(key(p["text_a"])), find(key(p["text_b"]))
        if (not duplicates_only or p["label"]) and ra != rb:
            parent[ra] = rb
    return {q: find(q) for q in list(parent)}
