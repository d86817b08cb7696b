import numpy as np

from cache.verifier import DEFAULT_ARTIFACT, Verifier


def test_artifact_is_small_and_records_its_training():
    assert DEFAULT_ARTIFACT.stat().st_size < 5 * 1024 * 1024
    v = Verifier.load()
    assert 0.0 < v.threshold < 1.0
    assert v.meta["seed"] and v.meta["calib"]["false_hit_rate"] <= 0.01


def test_shipped_artifacts_are_small():
    from cache.cross_verifier import DEFAULT_CROSS
    from cache.lora import DEFAULT_LORA

    total = sum(p.stat().st_size for p in (DEFAULT_ARTIFACT, DEFAULT_LORA, DEFAULT_CROSS) if p.exists())
    assert total < 5 * 1024 * 1024


def test_scores_are_symmetric_enough_and_rules_apply(embedder, mlp_verifier):
    verifier = mlp_verifier
    a, b = "How do I learn to swim as an adult?", "What is the best way for an adult to learn swimming?"
    ea, eb = embedder.encode([a, b])
    p_ab = verifier.score_pairs([a], [b], ea[None], eb[None])[0]
    p_ba = verifier.score_pairs([b], [a], eb[None], ea[None])[0]
    assert abs(p_ab - p_ba) < 0.1
    c = "How do I learn to swim in 3 weeks as an adult?"
    ec = embedder.encode([c])[0]
    assert verifier.score_pairs([a], [c], ea[None], ec[None])[0] == 0.0  # a number only one side has
    assert verifier.verify(a, ea, a, ea).same
    far = embedder.encode(["What is the GDP of Brazil?"])[0]
    assert not verifier.verify(a, ea, "What is the GDP of Brazil?", far).same
    assert isinstance(verifier.probabilities(np.zeros((1, verifier.mean.shape[0]), np.float32)), np.ndarray)
