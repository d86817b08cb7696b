import numpy as np

from cache.namespace import Namespace

NS_A = Namespace("tenant-a", "group-small")
NS_B = Namespace("tenant-b", "group-small")
USAGE = {"prompt_tokens": 12, "completion_tokens": 30, "cost_usd": 0.002}

QUESTION = "How can I improve my public speaking skills?"
PARAPHRASE = "How do I get better at public speaking?"


def test_paraphrase_hits_and_reports_similarity(make_cache):
    cache = make_cache()
    entry_id = cache.store(NS_A, QUESTION, "Practice, record yourself, join a club.", USAGE)
    hit = cache.lookup(NS_A, PARAPHRASE)
    assert hit is not None
    assert hit.entry_id == entry_id
    assert hit.answer.startswith("Practice")
    assert hit.usage["completion_tokens"] == 30
    assert 0.5 < hit.similarity <= 1.0
    assert cache.lookup(NS_A, QUESTION) is not None


def test_different_number_misses_despite_high_cosine(make_cache, embedder):
    cache = make_cache()
    a, b = "How do I lose 10 pounds in 2 weeks?", "How do I lose 20 pounds in 2 weeks?"
    ea, eb = embedder.encode([a, b])
    assert float(ea @ eb) > 0.8  # plain cosine would serve the wrong answer
    cache.store(NS_A, a, "30", USAGE)
    assert cache.lookup(NS_A, b) is None


def test_negation_misses_despite_high_cosine(make_cache, embedder):
    cache = make_cache()
    a, b = "Is coffee good for your health?", "Is coffee not good for your health?"
    ea, eb = embedder.encode([a, b])
    assert float(ea @ eb) > 0.8
    cache.store(NS_A, a, "In moderation, yes.", USAGE)
    assert cache.lookup(NS_A, b) is None


def test_different_entity_misses(make_cache):
    cache = make_cache()
    cache.store(NS_A, "What is the capital of France?", "Paris", USAGE)
    assert cache.lookup(NS_A, "What is the capital of Germany?") is None


def test_tenant_isolation(make_cache):
    cache = make_cache()
    cache.store(NS_A, QUESTION, "answer for A", USAGE)
    # Same question, same model group, another tenant: never served A's entry.
    assert cache.lookup(NS_B, QUESTION) is None
    assert cache.lookup(NS_B, PARAPHRASE) is None
    cache.store(NS_B, QUESTION, "answer for B", USAGE)
    assert cache.lookup(NS_B, QUESTION).answer == "answer for B"
    assert cache.lookup(NS_A, QUESTION).answer == "answer for A"


def test_isolation_holds_even_with_colliding_namespace_keys(make_cache):
    cache = make_cache()
    rng = np.random.default_rng(0)
    for i in range(50):
        cache.store(Namespace(f"tenant-{i % 5}", "same-key"), f"question number {i} about topic {i}", f"ans {i}")
    for i in range(50):
        hit = cache.lookup(Namespace("intruder", "same-key"), f"question number {i} about topic {i}")
        assert hit is None
    del rng


def test_ttl_expiry(make_cache, clock):
    cache = make_cache(ttl_s=60)
    cache.store(NS_A, QUESTION, "answer", USAGE)
    clock.advance(59)
    assert cache.lookup(NS_A, QUESTION) is not None
    clock.advance(2)
    assert cache.lookup(NS_A, QUESTION) is None
    assert len(cache) == 0


def test_lru_bound_evicts_least_recently_used(make_cache, clock):
    cache = make_cache(max_entries=3)
    questions = ["How do I bake sourdough bread?", "What is the tallest mountain in Africa?",
                 "How do vaccines train the immune system?", "Why is the sky blue?"]
    for q in questions[:3]:
        cache.store(NS_A, q, "a: " + q)
        clock.advance(1)
    assert cache.lookup(NS_A, questions[0]) is not None  # touch the oldest: now most recent
    clock.advance(1)
    cache.store(NS_A, questions[3], "a: " + questions[3])
    assert len(cache) == 3
    assert cache.lookup(NS_A, questions[1]) is None  # the least recently used went
    for q in (questions[0], questions[2], questions[3]):
        assert cache.lookup(NS_A, q) is not None


def test_persistence_across_restart(make_cache, tmp_path):
    directory = tmp_path / "persist"
    first = make_cache(directory)
    first.store(NS_A, QUESTION, "kept", USAGE)
    first.store(NS_B, "What is the boiling point of water at sea level?", "100 C", USAGE)
    assert first.lookup(NS_A, PARAPHRASE) is not None
    first.close()
    second = make_cache(directory)
    assert len(second) == 2
    hit = second.lookup(NS_A, PARAPHRASE)
    assert hit is not None and hit.answer == "kept"
    assert second.lookup(NS_B, QUESTION) is None
    stats = second.stats("tenant-a")
    assert stats.hits == 2 and stats.lookups == 2  # counters survive the restart too
    # New entries get fresh ids after a restart.
    new_id = second.store(NS_A, "Where do penguins live?", "south")
    assert new_id not in (hit.entry_id,)


def test_flush_removes_only_that_tenant(make_cache, tmp_path):
    directory = tmp_path / "flush"
    cache = make_cache(directory)
    cache.store(NS_A, QUESTION, "a")
    cache.store(Namespace("tenant-a", "group-large"), QUESTION, "a-large")
    cache.store(NS_B, QUESTION, "b")
    assert cache.flush("tenant-a") == 2
    assert cache.lookup(NS_A, QUESTION) is None
    assert cache.lookup(NS_B, QUESTION).answer == "b"
    cache.close()
    reopened = make_cache(directory)
    assert len(reopened) == 1
    assert reopened.lookup(NS_A, QUESTION) is None


def test_counters_track_hits_and_savings(make_cache):
    cache = make_cache(None)
    cache.store(NS_A, QUESTION, "answer", USAGE)
    cache.lookup(NS_A, PARAPHRASE)
    cache.lookup(NS_A, "What is the distance from the Earth to the Moon?")
    s = cache.stats("tenant-a")
    assert (s.lookups, s.hits) == (2, 1)
    assert s.saved_tokens == 42
    assert abs(s.saved_dollars - 0.002) < 1e-12
    assert cache.stats().hits == 1
    assert cache.stats("tenant-b").lookups == 0


def test_storing_the_same_prompt_replaces_the_answer(make_cache):
    cache = make_cache(None)
    cache.store(NS_A, QUESTION, "old")
    cache.store(NS_A, QUESTION, "new")
    assert len(cache) == 1
    assert cache.lookup(NS_A, QUESTION).answer == "new"


class CountingEmbedder:
    """The real embedder, counting the prompts it embeds."""

    def __init__(self, embedder) -> None:
        self.embedder, self.prompts = embedder, 0
        self.dim = embedder.dim

    def encode(self, texts, batch_size: int = 64):
        self.prompts += len(texts)
        return self.embedder.encode(texts, batch_size)

    def sees_all_of(self, text: str) -> bool:
        return self.embedder.sees_all_of(text)


def test_an_exact_repeat_is_served_without_embedding(embedder, verifier, clock, tmp_path):
    from cache.semantic_cache import SemanticCache

    counting = CountingEmbedder(embedder)
    # explore=0: the paraphrase below is a would-be hit, which exploration would turn into a `learning` lookup 5% of
    # the time
    cache = SemanticCache(tmp_path / "exact", embedder=counting, verifier=verifier, clock=clock, ttl_s=60, explore=0.0)
    entry_id = cache.store(NS_A, QUESTION, "answer", USAGE)
    assert counting.prompts == 1
    hit = cache.lookup(NS_A, QUESTION)
    assert (hit.entry_id, hit.similarity, hit.answer) == (entry_id, 1.0, "answer")
    assert counting.prompts == 1  # neither embedded nor verified
    assert cache.stats("tenant-a").hits == 1 and cache.stats("tenant-a").saved_tokens == 42
    assert cache.lookup(NS_B, QUESTION) is None  # another tenant's identical prompt goes the long way, and misses
    assert counting.prompts == 2
    assert cache.lookup(NS_A, PARAPHRASE).entry_id == entry_id
    assert counting.prompts == 3
    clock.advance(61)
    assert cache.lookup(NS_A, QUESTION) is None  # expired: not served, and removed
    assert len(cache) == 0
    cache.close()


def test_a_prompt_longer_than_the_embedder_reads_is_served_only_word_for_word(make_cache):
    """all-MiniLM reads 256 word pieces: two long prompts that differ only after that embed the same, so
    past that length only the very same text is a hit (found by a new user: a long document asked to be
    translated, then asked for its animals, got the translation)."""
    cache = make_cache()
    document = " ".join(f"The {i}th paragraph tells of a fox, a heron and a mole by the river." for i in range(40))
    first, second = f"{document}\nNow translate the first sentence into French.", f"{document}\nNow list three animals."
    assert not cache.embedder.sees_all_of(first)
    cache.store(NS_A, first, "Le premier paragraphe...", USAGE)
    assert cache.lookup(NS_A, second) is None
    assert cache.lookup(NS_A, first).answer == "Le premier paragraphe..."


def test_an_older_row_of_a_prompt_leaving_keeps_the_newer_one_served_without_embedding(embedder, verifier, clock,
                                                                                     tmp_path):
    """Two rows for one prompt (a database two gateway processes wrote): evicting the older must not drop the newer
    one's word-for-word match, so the repeat is still served without the embedder."""
    from cache.semantic_cache import DB_FILENAME, SemanticCache
    from cache.store import EntryStore, StoredEntry

    directory = tmp_path / "two-writers"
    directory.mkdir()
    vec = embedder.encode([QUESTION])[0]
    store = EntryStore(directory / DB_FILENAME)
    now = clock()
    store.insert_many([StoredEntry(1, NS_A.tenant, NS_A.key, QUESTION, vec, "older", USAGE, now - 2, now - 2),
                       StoredEntry(2, NS_A.tenant, NS_A.key, QUESTION, vec, "newer", USAGE, now - 1, now - 1)])
    store.close()
    counting = CountingEmbedder(embedder)
    cache = SemanticCache(directory, embedder=counting, verifier=verifier, clock=clock, max_entries=2, explore=0.0)
    cache.store(NS_A, "Where do penguins live?", "south")  # the least recently used row, the older, is evicted
    assert len(cache) == 2 and counting.prompts == 1
    hit = cache.lookup(NS_A, QUESTION)
    assert (hit.entry_id, hit.answer) == (2, "newer") and counting.prompts == 1
    cache.close()


def test_the_same_prompt_stored_while_it_is_embedded_is_an_exact_hit(make_cache):
    """A lookup that found no entry for its prompt, then embedded it while another request's answer to the very same
    prompt was stored, is that entry's word-for-word hit (score 1.0, so a flag removes it), not a paraphrase's."""
    cache = make_cache()
    prompt = "What is the capital of France?"
    embed = cache._embed

    def embed_while_the_answer_lands(text: str) -> np.ndarray:  # the race, injected: the store lands mid-embedding
        vec = embed(text)
        cache.store(NS_A, prompt, "Paris.")
        return vec

    cache._embed = embed_while_the_answer_lands
    found = cache.consult(NS_A, prompt)
    assert found.state == "hit" and found.score == 1.0
    cache.note_served("chatcmpl-race", NS_A, found)
    assert cache.flag(NS_A.tenant, "chatcmpl-race").removed
