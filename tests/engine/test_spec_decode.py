"""Speculative decoding in the engine: greedy output identical to plain decoding (n-gram and draft-model
proposers, continuous batching, chunked prefill, preemption, stops), every KV block back at the end,
prefix caching fed only verified tokens, the batch-size cut-off, and bad configs."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.random_models import write_random_checkpoint
from engine.spec_decode.ngram import lookup
from tests.engine.conftest import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def perturbed_draft_dir(tmp_path_factory):
    """The tiny llama with noise on every weight: a draft that agrees with it often, not always."""
    model = tiny_hf_model("llama")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    return str(path)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        head = torch.randint(3, 300, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
        out.append(head + head[: len(head) // 2])  # a repeat inside the prompt gives n-gram lookup something
    return out


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    proposer = engine.speculator.proposer if engine.speculator else None
    if proposer is not None and hasattr(proposer, "kv"):
        assert proposer.kv.num_used_blocks == 0


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}


# ---- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("config, field", [
    ("ngram", "speculative_config"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "draft", "num_speculative_tokens": 2}, "speculative_config.draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
    ({"method": "draft", "num_speculative_tokens": 2, "draft_model": "x", "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "speculative_config.k"),
])
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}: "):
        EngineConfig(model="random:llama-tiny", speculative_config=config)
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}: "):
        LLM("random:llama-tiny", speculative_config=config)


def test_draft_model_must_exist_and_share_the_vocabulary(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^speculative_config\.draft_model: .*no such model"):
        LLM(tiny_llama_dir, speculative_config={"method": "draft", "num_speculative_tokens": 2,
                                                "draft_model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=r"^speculative_config\.draft_model: its vocabulary has 512 tokens"):
        LLM(tiny_llama_dir, speculative_config={"method": "draft", "num_speculative_tokens": 2,
                                                "draft_model": "random:llama-tiny"})


def test_ngram_lookup_proposes_what_followed_the_suffix():
    assert lookup([5, 6, 7, 8, 9, 1, 5, 6, 7], 1, 3, 3) == [8, 9, 1]
    # the longest suffix decides: [6, 7] occurs twice, [5, 6, 7] once
    assert lookup([6, 7, 2, 5, 6, 7, 3, 4, 0, 5, 6, 7], 2, 3, 2) == [3, 4]
    # of equal matches the latest with k whole tokens after it wins
    assert lookup([1, 2, 10, 11, 1, 2, 20, 21, 1, 2], 2, 2, 2) == [20, 21]
    assert lookup([1, 2, 10, 1, 2], 2, 2, 3) == [10, 1, 2]
    assert lookup([1, 2, 3, 4], 2, 4, 3) == []  # no earlier occurrence
    assert lookup([4], 1, 4, 3) == []


# ---- greedy identity --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_case(tiny_llama_dir):
    """Six prompts with their own lengths, one stopped by a token from the middle of its output, and the
    outputs of plain decoding with room for everything."""
    batch = prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in [32, 10, 24, 32, 18, 32]]
    reference = token_ids(LLM(tiny_llama_dir, num_kv_blocks=256).generate(batch, params))
    stop_at = reference[3][13]
    params[3] = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_at])
    reference[3] = reference[3][: reference[3].index(stop_at) + 1]
    return batch, params, reference


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_identical_under_continuous_batching(tiny_llama_dir, perturbed_draft_dir, greedy_case,
                                                              method):
    batch, params, reference = greedy_case
    config = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3,
                                              "draft_model": perturbed_draft_dir}
    # 10 blocks of 16 slots for 6 sequences of up to 76 tokens, and prefill chunks beside the verifications
    llm = LLM(tiny_llama_dir, num_kv_blocks=10, max_num_batched_tokens=48, speculative_config=config)
    got = llm.generate(batch, params)
    assert token_ids(got) == reference
    assert got[3].outputs[0].finish_reason == "stop" and got[3].outputs[0].stop_reason == params[3].stop_token_ids[0]
    assert all(o.outputs[0].finish_reason == "length" for i, o in enumerate(got) if i != 3)
    stats = spec_stats(llm)
    assert llm.engine.metrics.num_preemptions > 0
    assert stats["spec_accepted_tokens"] > 0
    assert 0 < stats["spec_acceptance_rate"] < 1
    assert_all_blocks_free(llm)


def test_random_model_with_its_own_checkpoint_as_draft(tmp_path):
    draft = write_random_checkpoint("llama-tiny", str(tmp_path / "draft"), dtype=torch.float32)
    batch = prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = token_ids(LLM("random:llama-tiny").generate(batch, params))
    llm = LLM("random:llama-tiny", speculative_config={"method": "draft", "num_speculative_tokens": 4,
                                                       "draft_model": draft})
    assert token_ids(llm.generate(batch, params)) == reference
    assert spec_stats(llm)["spec_acceptance_rate"] == 1.0
    assert_all_blocks_free(llm)


def test_sequences_that_cannot_speculate_share_the_batch(tiny_llama_dir):
    """Penalties, logprobs and min_tokens decode plainly beside speculating sequences, with unchanged results."""
    batch = prompts(4, seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20),
    ]
    reference = LLM(tiny_llama_dir).generate(batch, params)
    llm = LLM(tiny_llama_dir, speculative_config=NGRAM)
    got = llm.generate(batch, params)
    assert token_ids(got) == token_ids(reference)
    for ref_lp, got_lp in zip(reference[2].outputs[0].logprobs, got[2].outputs[0].logprobs):
        assert got_lp.token_id == ref_lp.token_id
        assert got_lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-4)
    assert spec_stats(llm)["spec_draft_tokens"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_is_reproducible(tiny_llama_dir, perturbed_draft_dir, method):
    batch = prompts(3, seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(3)]
    config = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3,
                                              "draft_model": perturbed_draft_dir}
    runs = []
    for _ in range(2):
        llm = LLM(tiny_llama_dir, num_kv_blocks=6, speculative_config=config)
        runs.append(token_ids(llm.generate(batch, params)))
        assert spec_stats(llm)["spec_accepted_tokens"] > 0
        assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
    assert all(len(ids) == 24 for ids in runs[0])


def test_speculation_stops_at_the_batch_size_limit(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(prompts(4, seed=5), [8, 14, 40, 40])):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    verified_small, verified_large = 0, 0
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        before = engine.metrics.spec_verifications
        engine.step()
        if running >= 3:
            verified_large += engine.metrics.spec_verifications - before
        else:
            verified_small += engine.metrics.spec_verifications - before
    assert verified_large == 0
    assert verified_small > 0
    assert_all_blocks_free(llm)


def test_prefix_cache_holds_only_verified_tokens(tiny_llama_dir):
    """A follow-up request reuses the blocks a speculating request left behind; its output matches an engine
    without prefix caching, so no cached block held the KV of a rejected draft."""
    prompt = prompts(1, seed=6)[0]
    first = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(tiny_llama_dir, speculative_config=NGRAM)
    out = llm.generate([prompt], first)[0].outputs[0].token_ids
    assert spec_stats(llm)["spec_draft_tokens"] > spec_stats(llm)["spec_accepted_tokens"] > 0  # some were rejected
    follow_up = prompt + out + [7, 8, 9]
    second = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate([follow_up], second)[0]
    assert got.metrics.num_cached_tokens >= 48
    expected = LLM(tiny_llama_dir, enable_prefix_caching=False).generate([follow_up], second)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_all_blocks_free(llm)
