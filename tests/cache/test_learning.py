"""Per-entry thresholds that learn: a near miss answered by the model labels the entry; a flag stops it at once."""
from cache.namespace import Namespace

NS = Namespace("tenant-a", "group")
OTHER = Namespace("tenant-b", "group")
PARIS = "What is the capital of France?"
WHICH_CITY = "Which city is the capital of France?"  # the verifier scores it ~0.974 against PARIS
ANSWER = "The capital of France is Paris."


def test_near_miss_with_the_same_answer_lowers_the_entrys_threshold(make_cache):
    cache = make_cache()
    entry = cache.store(NS, PARIS, ANSWER)
    first = cache.consult(NS, WHICH_CITY)
    assert first.state == "learning" and first.entry_id == entry and first.score < first.threshold
    assert cache.learn(NS, entry, first.score, "  the capital of France is Paris. ") is True
    again = cache.consult(NS, WHICH_CITY)
    assert again.state == "hit" and again.hit.answer == ANSWER
    assert again.threshold == first.score < first.threshold  # served from the labelled score up


def test_near_miss_with_another_answer_blocks_that_neighbourhood(make_cache):
    cache = make_cache()
    entry = cache.store(NS, PARIS, ANSWER)
    first = cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05)
    assert first.state == "hit"  # 5% serves it before any label
    assert cache.learn(NS, entry, first.score, "Lyon is the largest city of the Rhône.") is False
    after = cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05)
    assert after.state == "learning" and after.threshold > first.score
    assert cache.lookup(NS, PARIS) is not None  # the prompt itself is still served


def test_labels_survive_a_restart(make_cache, tmp_path):
    cache = make_cache(tmp_path / "c")
    entry = cache.store(NS, PARIS, ANSWER)
    score = cache.consult(NS, WHICH_CITY).score
    cache.learn(NS, entry, score, ANSWER)
    cache.close()
    assert make_cache(tmp_path / "c").consult(NS, WHICH_CITY).state == "hit"


def test_static_cache_keeps_the_bounds_threshold_but_honours_flags(make_cache):
    cache = make_cache(learn=False)
    entry = cache.store(NS, PARIS, ANSWER)
    score = cache.consult(NS, WHICH_CITY).score
    cache.learn(NS, entry, score, ANSWER)
    assert cache.consult(NS, WHICH_CITY).state == "miss"  # no learning band either
    served = cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05)
    assert served.state == "hit"
    cache.note_served("chatcmpl-1", NS, served)
    assert cache.flag("tenant-a", "chatcmpl-1").removed is False
    assert cache.consult(NS, WHICH_CITY, max_false_hit_rate=0.05).state == "miss"


def test_only_the_tenant_served_can_flag_and_an_exact_flag_removes_the_entry(make_cache):
    cache = make_cache()
    cache.store(NS, PARIS, ANSWER)
    served = cache.consult(NS, PARIS)
    cache.note_served("chatcmpl-2", NS, served)
    assert cache.flag("tenant-b", "chatcmpl-2") is None
    assert cache.flag("tenant-a", "chatcmpl-unknown") is None
    flagged = cache.flag("tenant-a", "chatcmpl-2")
    assert flagged.removed and flagged.threshold is None
    assert cache.consult(NS, PARIS).state == "miss" and len(cache) == 0
    assert cache.learn(OTHER, served.entry_id, 0.99, ANSWER) is None  # gone, and never another tenant's
