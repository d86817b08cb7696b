from pathlib import Path
from typing import Callable

import pytest

from cache.embedder import Embedder


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    # Loaded once per session (a few seconds); the shared one, so code that calls
    # shared_embedder() (cache/eval.py) reuses it.
    from cache.embedder import shared_embedder

    return shared_embedder()


@pytest.fixture(scope="session")
def verifier(embedder):
    # The shipped one (cross-encoder when its artifact is present); embedder first: it extracts the model.
    from cache.semantic_cache import load_default_verifier

    return load_default_verifier()


@pytest.fixture(scope="session")
def mlp_verifier():
    from cache.verifier import Verifier

    return Verifier.load()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_cache(embedder, verifier, clock, tmp_path) -> Callable:
    from cache.semantic_cache import SemanticCache

    made = []

    def make(directory: Path | None = tmp_path / "cache", **kwargs):
        kwargs.setdefault("clock", clock)
        # no random exploration unless a test asks for it: a would-be hit stays a hit (tests/cache/test_pooled.py
        # covers exploration)
        kwargs.setdefault("explore", 0.0)
        cache = SemanticCache(directory, embedder=embedder, verifier=verifier, **kwargs)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()
