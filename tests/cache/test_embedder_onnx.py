"""The ONNX Runtime embedder against the same model in PyTorch (sentence-transformers), the independent reference."""
import logging

import numpy as np
import pytest

from cache import embedder_onnx
from cache.embedder import Embedder, ensure_model_dir
from cache.lora import DEFAULT_LORA

TEXTS = [
    "How do I learn Excel quickly?",
    "  leading and trailing spaces  ",
    "",
    "Ünïcödé — why does this question have accents?",
    "a long prompt " * 300,  # past the model's 256 tokens: truncated the same way
    "What is the best way to lose weight without dieting?",
    "Why?",
]


@pytest.fixture(scope="module")
def torch_embedder() -> Embedder:
    return Embedder(backend="torch")


def test_the_shared_embedder_runs_through_onnx(embedder):
    assert embedder.backend == "onnx"
    assert sum(t.numel() for t in embedder._model.parameters()) == 0  # PyTorch's copy of the weights is released
    assert embedder.encode_one("still embeds").shape == (384,)
    stats = embedder.threading_stats()
    assert stats["threads"] >= 1 and stats["prompts_on_several_threads"] >= 0


def test_onnx_vectors_equal_pytorch_vectors(embedder, torch_embedder):
    got = embedder.encode(TEXTS, batch_size=3)  # batches of mixed lengths: padding and reordering
    want = torch_embedder.encode(TEXTS, batch_size=3)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    one_by_one = np.stack([embedder.encode_one(t) for t in TEXTS])
    np.testing.assert_allclose(one_by_one, got, atol=1e-5)


def test_onnx_vectors_on_random_words(embedder, torch_embedder):
    rng = np.random.default_rng(0)
    words = "cache model tenant question answer price token GPU replica the a of why how what is".split()
    texts = [" ".join(rng.choice(words, size=rng.integers(1, 40))) for _ in range(20)]
    np.testing.assert_allclose(embedder.encode(texts), torch_embedder.encode(texts), atol=1e-5)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend"):
        Embedder(backend="tpu")
    with pytest.raises(ValueError, match="backend"):
        Embedder(device="cuda", backend="onnx")


def test_the_export_is_named_by_the_deltas_it_holds(tmp_path, embedder):
    model_dir = ensure_model_dir()
    other = tmp_path / "other_lora.npz"
    other.write_bytes(DEFAULT_LORA.read_bytes() + b"changed")
    shipped = embedder_onnx.export_path(model_dir, DEFAULT_LORA)
    assert shipped.exists()  # written when the shared embedder loaded
    assert embedder_onnx.export_path(model_dir, other) != shipped
    assert embedder_onnx.export_path(model_dir, None) != shipped


def test_without_onnxruntime_the_embedder_runs_in_pytorch(monkeypatch, caplog, torch_embedder):
    monkeypatch.setattr(embedder_onnx, "available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cache.embedder"):
        fallback = Embedder(backend="onnx")
    assert fallback.backend == "torch" and fallback.threading_stats() == {}
    assert "onnxruntime" in caplog.text
    np.testing.assert_allclose(fallback.encode(TEXTS[:2]), torch_embedder.encode(TEXTS[:2]), atol=1e-6)


def _tokenized(embedder, texts):
    return embedder._model.preprocess(texts)


def test_two_threads_run_while_a_core_is_free_and_give_the_same_vectors(monkeypatch, embedder):
    path = embedder_onnx.export_path(ensure_model_dir(), DEFAULT_LORA)
    encoder = embedder_onnx.OnnxEncoder(path, threads=2)
    single = embedder_onnx.OnnxEncoder(path, threads=1)
    features = _tokenized(embedder, TEXTS[:4])
    cores = 2
    monkeypatch.setattr(embedder_onnx.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(embedder_onnx, "_other_runnable_tasks", lambda: 0)
    parallel = encoder(features)
    assert encoder.parallel_calls == 1
    monkeypatch.setattr(embedder_onnx, "_other_runnable_tasks", lambda: 1)  # the other core is busy
    encoder(features)
    monkeypatch.setattr(embedder_onnx, "_other_runnable_tasks", lambda: None)  # no /proc/loadavg: stay on one
    encoder(features)
    assert encoder.parallel_calls == 1
    np.testing.assert_allclose(parallel, single(features), atol=1e-6)
    assert single.parallel_calls == 0 and single._parallel is None


def test_the_host_reports_its_runnable_tasks():
    others = embedder_onnx._other_runnable_tasks()
    assert others is None or others >= 0  # this test itself is running


def test_thread_count_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOLLGATE_EMBEDDER_THREADS", "1")
    assert embedder_onnx.default_threads() == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("TOLLGATE_EMBEDDER_THREADS", bad)
        with pytest.raises(ValueError, match="TOLLGATE_EMBEDDER_THREADS"):
            embedder_onnx.default_threads()
    monkeypatch.delenv("TOLLGATE_EMBEDDER_THREADS")
    assert 1 <= embedder_onnx.default_threads() <= 2


def test_a_new_export_removes_the_same_models_older_ones(tmp_path):
    names = ["all-MiniLM-L6-v2-aaaa-opset17.onnx", "all-MiniLM-L6-v2-bbbb-opset17.onnx",
             "all-MiniLM-L6-v2-cccc-opset16.onnx", "other-model-dddd-opset17.onnx", "all-MiniLM-L6-v2.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    embedder_onnx.remove_other_exports(tmp_path / names[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:2] + names[3:])
