"""A tenant's threshold learned from its labelled lookups (cache/pooled.py): it moves only as far as the labels
certify, never below the learning floor, never for a tenant whose labels say its near misses are wrong, and the
cache explores a share of would-be hits so labels keep coming where it serves."""
import numpy as np
import pytest
from scipy.stats import poisson

from cache.bounds import Bound
from cache.namespace import Namespace
from cache.pooled import MIN_LABELS, TenantCalibration, per_lookup_budget

BOUND = Bound(0.01, threshold=0.984, learning_floor=0.918)
NS = Namespace("tenant-a", "group")
PARIS = "What is the capital of France?"
WHICH_CITY = "Which city is the capital of France?"  # the verifier scores it ~0.974 against PARIS: learning at 1%
ANSWER = "The capital of France is Paris."


def calibration(same_share: float, n_labels: int = 400, n_lookups: int = 5000, seed: int = 0) -> TenantCalibration:
    """Lookups whose best scores spread over [0.9, 1); labels drawn at those scores, `same_share` of them right."""
    rng = np.random.default_rng(seed)
    c = TenantCalibration()
    scores = 1 - 10 ** rng.uniform(-4, -1, n_lookups)
    for s in scores[: n_lookups // 10]:
        c.observe(float(s))
    for _ in range(n_lookups - n_lookups // 10):
        c.observe(None)  # word-for-word repeats and lookups with no candidate
    for s in rng.choice(scores, n_labels):
        c.add_label(float(s), bool(rng.random() < same_share))
    return c


def test_labels_that_say_near_misses_ask_the_same_question_lower_the_threshold():
    c = calibration(same_share=0.999)
    c.thresholds = TenantCalibration.refit(*c.snapshot(), [BOUND])
    assert BOUND.learning_floor <= c.threshold(BOUND) < BOUND.threshold


def test_labels_that_say_near_misses_are_different_questions_keep_the_calibrated_threshold():
    c = calibration(same_share=0.5)
    c.thresholds = TenantCalibration.refit(*c.snapshot(), [BOUND])
    assert c.threshold(BOUND) == BOUND.threshold


def test_nothing_is_learned_before_enough_labels():
    c = calibration(same_share=1.0, n_labels=MIN_LABELS - 1)
    assert TenantCalibration.refit(*c.snapshot(), [BOUND]) == {}


def test_the_per_window_budget_keeps_a_windows_false_hits_within_the_bound():
    for delta in (0.002, 0.01, 0.02, 0.05):
        rate = per_lookup_budget(delta, 1000)
        assert rate < delta
        assert poisson.sf(int(delta * 1000), rate * 1000) <= 0.01 + 1e-12 < poisson.sf(int(delta * 1000), rate * 1000 * 1.05)
    assert per_lookup_budget(0.01, None) == 0.01


def test_the_learned_state_survives_a_restart(make_cache, tmp_path):
    cache = make_cache(tmp_path / "c")
    entry = cache.store(NS, PARIS, ANSWER)
    score = cache.consult(NS, WHICH_CITY).score
    for _ in range(MIN_LABELS):
        cache.label(NS, entry, score, True)
    learned = cache.learned_thresholds(NS.tenant)
    cache.close()
    again = make_cache(tmp_path / "c")
    assert again.label_count(NS.tenant) == MIN_LABELS
    assert again.learned_thresholds(NS.tenant) == learned


def test_a_tenants_labels_move_only_its_own_threshold(make_cache):
    cache = make_cache()
    entry = cache.store(NS, PARIS, ANSWER)
    other = Namespace("tenant-b", "group")
    cache.store(other, PARIS, ANSWER)
    for _ in range(10):  # lookups that need the verifier, then their labels
        score = cache.consult(NS, WHICH_CITY).score
    for _ in range(1000):  # word-for-word repeats: lookups that are never false hits
        cache.consult(NS, PARIS)
    for s in np.linspace(score, 0.999, 3 * MIN_LABELS):
        cache.label(NS, entry, float(s), True)
    assert cache.learned_thresholds(NS.tenant)[0.01] < cache.learned_thresholds("tenant-b")[0.01]
    assert cache.consult(other, WHICH_CITY).state == "learning"  # tenant b still at its calibrated threshold
    cache.flush(NS.tenant)
    assert cache.label_count(NS.tenant) == 0


def test_exploration_sends_would_be_hits_to_the_model_but_never_a_word_for_word_repeat(make_cache):
    cache = make_cache(explore=1.0)
    cache.store(NS, PARIS, ANSWER)
    explored = cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05)  # a hit at 5% without exploration
    assert explored.state == "learning" and explored.explored and explored.hit is None
    assert cache.consult(NS, PARIS).state == "hit"


def test_a_flag_never_counts_as_a_pooled_label(make_cache):
    cache = make_cache()
    cache.store(NS, PARIS, ANSWER)
    served = cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05)
    cache.note_served("chatcmpl-x", NS, served)
    cache.flag(NS.tenant, "chatcmpl-x")
    assert cache.label_count(NS.tenant) == 0
    assert cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05).state != "hit"  # the entry stopped at once


def test_the_window_tail_is_scipys_poisson_tail():
    """The per-window bound's Poisson tail (computed here without scipy, which the product does not install) agrees
    with scipy's survival function."""
    from scipy.stats import poisson

    from cache.pooled import poisson_tail

    for k, mean in [(0, 0.5), (10, 3.2), (20, 11.7), (50, 40.0), (2, 9.0)]:
        assert poisson_tail(k, mean) == pytest.approx(poisson.sf(k, mean), rel=1e-9, abs=1e-15)
