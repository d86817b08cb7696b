"""Decode graphs captured on first use (engine/cuda_graphs.py): a new engine captures none, a decode step of a new
shape captures its graph, mid-generation too, without touching the KV of the sequences in flight, and the tokens
are those of the same engine run eagerly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 19, 44, 8, 30)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graphs_are_captured_as_decode_steps_need_them_and_keep_the_eager_tokens(tiny_llama_dir, async_scheduling):
    shape = dict(device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                 async_scheduling=async_scheduling)
    eager = LLM(tiny_llama_dir, enforce_eager=True, **shape)
    graphed = LLM(tiny_llama_dir, **shape)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and not graphs.graphs  # nothing captured at start
    replays = []
    run = graphs.run
    graphs.run = lambda host, previous: replays.append(graphs.key(host)) or run(host, previous)

    prompts = _prompts()
    # five sequences finishing one after another: decode batches of 5, 4, 3, 2 and 1, so the graphs of buckets 4,
    # 2 and 1 are captured while other sequences' KV is in the pool
    lengths = [40, 32, 24, 16, 8]
    assert _greedy(graphed, prompts, lengths) == _greedy(eager, prompts, lengths)
    assert set(graphs.graphs) == {(8, 16), (4, 16), (2, 16), (1, 16)} == set(replays)
    captured = dict(graphs.graphs)

    replays.clear()
    assert _greedy(graphed, prompts[:3], [12] * 3) == _greedy(eager, prompts[:3], [12] * 3)
    assert set(replays) == {(4, 16)}
    assert all(graphs.graphs[key] is graph for key, graph in captured.items())  # replayed, not captured again
    assert graphed.engine.kv.num_used_blocks == 0
