"""A KV pool too small for every request at once: preemption by recompute, same outputs, no leaked block."""

import torch

from engine import LLM, SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_small_pool_gives_unconstrained_outputs(tiny_llama_dir):
    batch = prompts(8)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in range(8)]
    roomy = LLM(tiny_llama_dir, num_kv_blocks=256)
    expected_greedy = [o.outputs[0].token_ids for o in roomy.generate(batch, greedy)]
    expected_seeded = [o.outputs[0].token_ids for o in roomy.generate(batch, seeded)]

    tight = LLM(tiny_llama_dir, num_kv_blocks=10)  # 160 token slots for 8 sequences of up to 80 tokens
    got_greedy = [o.outputs[0].token_ids for o in tight.generate(batch, greedy)]
    assert tight.engine.metrics.num_preemptions > 0
    got_seeded = [o.outputs[0].token_ids for o in tight.generate(batch, seeded)]
    assert got_greedy == expected_greedy
    assert got_seeded == expected_seeded
    assert tight.engine.kv.num_used_blocks == 0
    assert tight.engine.kv.num_free_blocks == 10


def test_aborts_free_every_block(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=10)
    engine = llm.engine
    for i, prompt in enumerate(prompts(6, seed=1)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.kv.num_used_blocks > 0
    for i in (0, 2, 4):
        out = engine.abort_request(f"r{i}")
        assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_priority_orders_admission_and_preemption(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=8, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("low", list(range(1, 30)), params, priority=5)
    engine.add_request("high", list(range(40, 69)), params, priority=0)
    engine.add_request("mid", list(range(80, 109)), params, priority=1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("high") < finished.index("low")
    assert finished.index("mid") < finished.index("low")
    assert engine.kv.num_used_blocks == 0
