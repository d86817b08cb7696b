"""The quality bars of issue 8 on SmolLM2 (CPU, float32): int8 weights and an fp8 KV cache keep top-1
agreement with the unquantized model >= 95% on ShareGPT prompts. bench/quantization_quality.py
measures every mode on more prompts."""

from __future__ import annotations

import os

import pytest
import torch

from bench.quantization_quality import load_prompt_ids, prepare_mode, reset_kv_scales, score

NUM_PROMPTS, MAX_TOKENS = 8, 64


@pytest.fixture(scope="module")
def smollm2_baseline(smollm2, shared_data_dir):
    path = os.path.join(shared_data_dir, "prompts_sample.jsonl")
    if not os.path.isfile(path):
        pytest.skip("../shared/data/prompts_sample.jsonl is absent")
    model, tokenizer = smollm2.engine.runner.model, smollm2.engine.tokenizer
    prompts = load_prompt_ids(tokenizer, model.config.vocab_size, NUM_PROMPTS, MAX_TOKENS, path)
    base, top1 = score(model, prompts, torch.float32, None)
    return model, tokenizer, prompts, base, top1


@pytest.mark.parametrize("mode", ["int8", "kv_fp8"])
def test_top1_agreement_at_least_95_percent(smollm2_baseline, mode: str) -> None:
    model, tokenizer, prompts, base, top1 = smollm2_baseline
    try:
        quantized, kv_dtype = prepare_mode(model, mode, tokenizer)
        scored, _ = score(quantized, prompts, kv_dtype, top1)
    finally:
        reset_kv_scales(model)
    assert scored.positions > 200
    assert scored.top1_agreement >= 0.95, f"{mode}: top-1 agreement {scored.top1_agreement:.2%}"
    assert scored.perplexity < 1.05 * base.perplexity
