"""Async scheduling (step N+1 launched before step N's tokens are read) against the same engine stepping
synchronously: identical tokens for every sampling feature, no placeholder ever visible, no leaked block."""

import torch

from engine import LLM, SamplingParams
from engine.deferred_tokens import PENDING_TOKEN


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 300, (20,), generator=gen).tolist()  # a common prefix for the prefix cache
    return [shared + torch.randint(0, 300, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def mixed_params(stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=4, presence_penalty=0.8, frequency_penalty=0.5, max_tokens=20),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0, stop_token_ids=[stop_id], max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, stop_token_ids=[stop_id], min_tokens=12, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=9, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=10, ignore_eos=True),  # its steps read synchronously
    ]


def run(model_dir: str, batch, params, **config) -> list:
    llm = LLM(model_dir, **config)
    outputs = llm.generate(batch, params)
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 4)) for lp in c.logprobs])
             for c in out.outputs] for out in outputs]


def test_async_and_sync_scheduling_give_identical_outputs(tiny_llama_dir):
    batch = prompts(8)
    batch[5] = batch[4]  # the same stop token, once with min_tokens past it
    probe = LLM(tiny_llama_dir).generate([batch[4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop_id = probe[0].outputs[0].token_ids[4]  # greedy reaches it early: a stop mid-run
    params = mixed_params(stop_id)
    for config in (dict(num_kv_blocks=256), dict(num_kv_blocks=12), dict(num_kv_blocks=256, max_num_batched_tokens=32)):
        synced = run(tiny_llama_dir, batch, params, async_scheduling=False, **config)
        overlapped = run(tiny_llama_dir, batch, params, async_scheduling=True, **config)
        assert overlapped == synced, config
    assert synced[4][0][1] == "stop" and synced[4][0][2] == stop_id
    assert len(synced[4][0][0]) == 5 and len(synced[5][0][0]) >= 12


def test_placeholder_is_never_seen_and_abort_in_flight_frees_blocks(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, num_kv_blocks=64).engine
    assert engine.overlap
    for i, prompt in enumerate(prompts(3, seed=1)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen = []
    for _ in range(4):
        seen += engine.step()
    assert engine.in_flight is not None
    seq = engine.requests["r1"].seqs[0]
    assert seq.token_ids[-1] == PENDING_TOKEN  # launched, not read yet
    aborted = engine.abort_request("r1")
    assert aborted.finished and PENDING_TOKEN not in aborted.outputs[0].token_ids
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert all(PENDING_TOKEN not in c.token_ids and PENDING_TOKEN not in c.delta_token_ids
               for out in seen for c in out.outputs)
    assert engine.kv.num_used_blocks == 0


def test_no_step_is_spent_past_max_tokens(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    steps = []
    for overlap in (False, True):
        llm = LLM(tiny_llama_dir, async_scheduling=overlap)
        llm.generate([[5, 6, 7]], params)
        steps.append(llm.engine.metrics.num_steps)
    assert steps == [6, 6]  # one prefill, five decodes


def test_speculative_decoding_steps_synchronously(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not llm.engine.overlap


def test_context_buckets_of_decode_graphs():
    from engine.cuda_graphs import context_buckets

    assert context_buckets(256, 16) == [16, 32, 64, 128, 256]  # 4k context: 256, 512, 1k, 2k tokens, full
    assert context_buckets(32, 16) == [16, 32]
    assert context_buckets(10, 16) == [10]  # shorter than the first bucket: the full width only
    assert context_buckets(17, 16) == [16, 17]


def test_a_step_that_fails_to_launch_keeps_the_tokens_in_flight(tiny_llama_dir):
    batch = prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, async_scheduling=False).generate(batch, params)]
    engine = LLM(tiny_llama_dir).engine
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params, stream=False)
    engine.step()
    engine.step()
    assert engine.in_flight is not None
    original = engine.runner.forward_logits

    def fail_once(*args):
        engine.runner.forward_logits = original
        raise RuntimeError("injected: the forward pass failed to launch")

    engine.runner.forward_logits = fail_once
    try:
        engine.step()
    except RuntimeError as e:
        assert "injected" in str(e)
    else:
        raise AssertionError("the injected failure did not surface")
    assert engine.in_flight is not None  # the pending tokens can still be read
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [done[str(i)] for i in range(3)] == expected
    assert engine.kv.num_used_blocks == 0


def test_each_step_takes_the_token_path_its_sequences_allow(tiny_llama_dir):
    """ModelRunner.token_path: plain steps of an async engine defer their tokens, a step returning logprobs and every
    step of a synchronous engine sample at once, steps that verify drafts go through rejection sampling."""
    from unittest import mock

    from engine.runner import TokenPath

    def paths(params: SamplingParams, **config) -> set[TokenPath]:
        engine = LLM(tiny_llama_dir, **config).engine
        seen = []
        original = engine.runner.token_path
        with mock.patch.object(engine.runner, "token_path", lambda *a: seen.append(original(*a)) or seen[-1]):
            engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], params)
            while engine.has_unfinished_requests():
                engine.step()
        return set(seen)

    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert paths(plain) == {TokenPath.DEFERRED}
    assert paths(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)) == {TokenPath.SAMPLED}
    assert paths(plain, async_scheduling=False) == {TokenPath.SAMPLED}
    speculative = paths(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert TokenPath.SPECULATIVE in speculative and TokenPath.DEFERRED not in speculative
