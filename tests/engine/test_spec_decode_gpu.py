"""Speculative decoding on CUDA: verify steps replay their own CUDA graphs, and greedy output equals
plain decoding (float32, so the decode and prefill kernels agree far beyond any near-tie)."""

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for n in (5, 12, 23, 40):
        head = torch.randint(3, 300, (n,), generator=gen).tolist()
        out.append(head + head)  # the repeat gives prompt lookup drafts to propose
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_verify_graphs_keep_greedy_output(tiny_llama_dir, batch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts()[:batch]
    plain = LLM(tiny_llama_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    spec = LLM(tiny_llama_dir, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    graphs = spec.engine.runner.verify_graphs
    assert graphs is not None and graphs.q == 5
    replays = []
    original = graphs.run
    graphs.run = lambda host, previous: replays.append(host.num_tokens) or original(host, previous)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == expected
    assert all(n % 5 == 0 for n in replays)
    if batch == 1:  # one sequence with 4 drafts every step: each verify step is a graph's shape
        assert replays
    assert spec.engine.stats()["spec_accepted_tokens"] > 0
    assert spec.engine.kv.num_used_blocks == 0
