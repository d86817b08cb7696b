"""The tenant's false-hit bound δ: thresholds calibrated with a finite-sample guarantee hold on pairs never used to
calibrate them (paraphrase_dev.jsonl), through the real cache lookup path."""
import json

import numpy as np
import pytest
from scipy.stats import binom

from cache.bounds import OFFERED, TABLE, FalseHitBounds, check_max_false_hit_rate, shipped_bounds
from cache.conformal import ltt_threshold
from cache.eval import evaluate, main
from tollgate import envs

DEV = envs.get("TOLLGATE_DATA_DIR") / "paraphrase_dev.jsonl"


@pytest.fixture(scope="module")
def dev_pairs(embedder):
    if not DEV.exists():
        pytest.skip(f"{DEV} is absent (see ../shared/data/README.md)")
    pairs = [json.loads(line) for line in DEV.read_text().splitlines() if line.strip()]
    return pairs, (embedder.encode([p["a"] for p in pairs]), embedder.encode([p["b"] for p in pairs]))


@pytest.fixture(scope="module")
def static_cache(embedder, verifier):
    from cache.semantic_cache import SemanticCache

    cache = SemanticCache(None, embedder=embedder, verifier=verifier, learn=False)
    yield cache
    cache.close()


def test_held_out_false_hit_rate_stays_within_each_offered_bound(dev_pairs, static_cache):
    # 1,000 held-out pairs (~6 s to embed once): the bound is a statement about rates, so it needs this many.
    pairs, embeddings = dev_pairs
    for delta in OFFERED:
        result = evaluate(pairs, static_cache, delta, embeddings)
        # the guarantee: the rate is <= δ with 99% confidence over the calibration draw; on 500 held-out
        # non-duplicates the count still varies by sampling, so the check allows Binomial(500, δ)'s 99.9th percentile
        allowed = binom.ppf(0.999, result["non_duplicates"], delta)
        assert result["false_hits"] <= allowed, (delta, result)
        assert result["max_false_hit_rate"] == delta


def test_looser_bound_serves_more_duplicates(dev_pairs, static_cache):
    pairs, embeddings = dev_pairs
    hit_rates = [evaluate(pairs, static_cache, d, embeddings)["hit_rate"] for d in (0.002, 0.01, 0.05)]
    assert hit_rates[0] < hit_rates[1] < hit_rates[2]
    assert hit_rates[1] > 0.15


def test_verifier_serves_more_than_its_own_embedders_cosine_calibrated_the_same_way(dev_pairs, static_cache):
    pairs, (ea, eb) = dev_pairs
    table = json.loads(TABLE.read_text())
    at_1 = next(b for b in table["bounds"] if b["max_false_hit_rate"] == 0.01)
    labels = np.array([p["duplicate"] for p in pairs])
    cosine = np.sum(ea * eb, axis=1)
    cosine_hits = cosine[labels] >= at_1["tuned_cosine_threshold"]
    ours = evaluate(pairs, static_cache, 0.01, (ea, eb))
    assert ours["hit_rate"] > cosine_hits.mean()


def test_threshold_is_the_lowest_one_the_binomial_test_certifies():
    rng = np.random.default_rng(3)
    negatives = rng.beta(2, 5, size=3000)
    for delta, alpha in ((0.01, 0.01), (0.05, 0.05)):
        t = ltt_threshold(negatives, delta, alpha)
        served = int((negatives >= t).sum())
        assert binom.cdf(served, len(negatives), delta) <= alpha
        just_below = np.max(negatives[negatives < t])  # one more negative served fails the test
        assert binom.cdf(int((negatives >= just_below).sum()), len(negatives), delta) > alpha
    assert ltt_threshold(negatives[:100], 0.002, 0.01) == np.inf  # too few negatives to certify 0.2%


def test_requested_bound_rounds_down_to_an_offered_one():
    bounds = shipped_bounds()
    assert bounds.choices == OFFERED
    assert bounds.at(0.015).max_false_hit_rate == 0.01
    assert bounds.at(None).max_false_hit_rate == 0.01
    assert bounds.at(0.002).threshold > bounds.at(0.01).threshold > bounds.at(0.05).threshold
    with pytest.raises(ValueError, match="max_false_hit_rate"):
        bounds.at(0.001)
    with pytest.raises(ValueError, match="cache_max_false_hit_rate"):
        check_max_false_hit_rate(0.03)
    assert isinstance(FalseHitBounds.single(0.9).at(0.05).threshold, float)


def test_eval_cli_reports_rates_at_the_bound_asked(tmp_path, capsys, embedder):
    path = tmp_path / "pairs.json"  # qqp_pairs.json's shape
    path.write_text(json.dumps([
        {"text_a": "How can I learn Spanish fast?", "text_b": "What is the fastest way to learn Spanish?", "label": 1},
        {"text_a": "What is 15% of 200?", "text_b": "What is 15% of 300?", "label": 0},
    ]))
    assert main(["--pairs", str(path), "--max-false-hit-rate", "0.02", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_false_hit_rate"] == 0.02 and out["false_hit_rate"] == 0.0 and out["pairs"] == 2
    with pytest.raises(SystemExit):
        main(["--pairs", str(path), "--max-false-hit-rate", "0.03"])
    assert "invalid choice" in capsys.readouterr().err
