"""Prefill and decode logits of the paged engine equal HF transformers' on tiny random models,
for several sequences in one continuous batch, prefilled in chunks, across block boundaries."""

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.conftest import tiny_hf_model

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama3-untied": ("llama", dict(rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False)),
    "llama2-tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=16, tie_word_embeddings=False)),
    "mistral": ("mistral", dict(sliding_window=None)),
}


def run_and_capture_logits(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int):
    """Runs the prompts to completion; returns outputs and, per request, the logits of every sampled position."""
    captured: dict[str, list[tuple[int, torch.Tensor]]] = {rid: [] for rid in prompts}
    original = engine.runner.forward_logits

    def spy(batch, previous=None):
        logits, seqs = original(batch, previous)
        for row, seq in zip(logits, seqs):
            captured[seq.request_id].append((seq.num_tokens, row.clone()))
        return logits, seqs

    engine.runner.forward_logits = spy
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    finally:  # a second run on the same engine spies afresh
        engine.runner.forward_logits = original
    return outputs, captured


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(case, tmp_path):
    arch, overrides = CASES[case]
    hf = tiny_hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path)
    # 24-token budget: the 37- and 50-token prompts are prefilled in chunks next to other sequences' decodes
    engine = LLMEngine(EngineConfig(model=str(tmp_path), max_num_batched_tokens=24, num_kv_blocks=64, block_size=16))
    gen = torch.Generator().manual_seed(1)
    prompts = {
        "a": torch.randint(0, 300, (37,), generator=gen).tolist(),
        "b": torch.randint(0, 300, (3,), generator=gen).tolist(),
        "c": torch.randint(0, 300, (50,), generator=gen).tolist(),
    }
    outputs, captured = run_and_capture_logits(engine, prompts, max_tokens=20)
    for rid, prompt in prompts.items():
        full = prompt + outputs[rid].outputs[0].token_ids
        assert len(outputs[rid].outputs[0].token_ids) == 20
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].float()
        assert len(captured[rid]) == 20  # the prefill's last position, then 19 decodes
        for num_tokens, logits in captured[rid]:
            torch.testing.assert_close(logits, ref[num_tokens - 1], atol=2e-5, rtol=1e-4)
    assert engine.kv.num_used_blocks == 0
