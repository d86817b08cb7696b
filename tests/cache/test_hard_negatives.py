"""Never the opposite question: 265 hand-written pairs that embeddings confuse (opposite actions, negation, swapped
conversion direction, other numbers, units, dates, names, languages, a changed earlier turn) all miss, at every
offered bound, through the real lookup path. The pairs (tests/data/cache_hard_negatives.jsonl) are used by no
training or calibration."""
import json
from collections import Counter
from pathlib import Path

from cache.bounds import OFFERED
from cache.namespace import namespace_for_request

PAIRS = [json.loads(line) for line in
         (Path(__file__).parents[1] / "data" / "cache_hard_negatives.jsonl").read_text().splitlines() if line]


def request(context: list, last: str) -> dict:
    return {"model": "m", "temperature": 0, "messages": [*context, {"role": "user", "content": last}]}


def test_the_set_covers_each_kind_of_hard_negative():
    kinds = Counter(p["kind"] for p in PAIRS)
    assert len(PAIRS) >= 200
    assert set(kinds) == {"opposite_action", "negation", "swapped_direction", "numbers", "units", "dates", "entities",
                          "languages", "earlier_turn"}


def test_no_hard_negative_is_served_at_any_bound(make_cache, embedder):
    cache = make_cache(None)
    a_vecs = embedder.encode([p["a"] for p in PAIRS])
    b_vecs = embedder.encode([p["b"] for p in PAIRS])
    served = []
    for i, p in enumerate(PAIRS):
        # each pair in a model group of its own: the only candidate is the pair's other prompt
        ns_a = namespace_for_request("t", f"m{i}", request(p.get("context_a", []), p["a"])).namespace
        ns_b = namespace_for_request("t", f"m{i}", request(p.get("context_b", []), p["b"])).namespace
        cache.store(ns_a, p["a"], f"answer {i}", embedding=a_vecs[i])
        for delta in OFFERED:
            found = cache.consult(ns_b, p["b"], b_vecs[i], max_false_hit_rate=delta)
            if found.state != "miss" and found.entry_id is not None:
                served.append((p["kind"], delta, found.state, p["a"], p["b"]))
    assert served == []  # not even "learning": no label could ever open these
