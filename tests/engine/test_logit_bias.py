"""OpenAI's logit_bias in the batched sampler and the engine, against PyTorch / HF transformers references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingRow, add_logit_bias

PROMPT = [5, 17, 42, 99, 120, 7, 33, 250, 61]


def row(params: SamplingParams, output: list[int] | None = None) -> SamplingRow:
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, [], output or [], generator)


def reference_adjusted(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """Bias added to each named logit, then OpenAI's frequency / presence penalties over the output so far."""
    out = logits.double().clone()
    for i, (p, output) in enumerate(zip(params, outputs)):
        for token, bias in (p.logit_bias or {}).items():
            out[i, token] += bias
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=out.shape[1]).double()
        out[i] -= counts * p.frequency_penalty + (counts > 0).double() * p.presence_penalty
    return out


def test_bias_is_added_to_each_rows_own_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 37, dtype=torch.bfloat16)
    original = logits.clone()
    params = [SamplingParams(logit_bias={3: 5.5, 36: -100}), SamplingParams(),
              SamplingParams(logit_bias={0: 100, 3: -2.25}), SamplingParams(logit_bias={})]
    biased = add_logit_bias(logits, params)
    expected = reference_adjusted(logits, params, [[]] * 4).float()
    assert biased.dtype == torch.float32 and torch.equal(logits, original)
    torch.testing.assert_close(biased, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_picks_follow_bias_and_penalties_on_random_rows(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 7, 61
    logits = torch.randn(batch, vocab, generator=gen) * 3
    params, outputs = [], []
    for i in range(batch):
        tokens = torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
        bias = {int(t): round(float(torch.empty(1).uniform_(-100, 100, generator=gen)), 3)
                for t in torch.randint(0, vocab, (i,), generator=gen)}
        params.append(SamplingParams(temperature=0.0, logit_bias=bias or None, frequency_penalty=0.5 * (i % 3),
                                     presence_penalty=0.25 * (i % 2)))
        outputs.append(tokens)
    picked = Sampler()(logits, [row(p, o) for p, o in zip(params, outputs)]).token_ids
    assert picked == reference_adjusted(logits, params, outputs).argmax(dim=-1).tolist()


def test_sampled_frequencies_follow_the_biased_softmax() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    bias = {0: -100.0, 3: math.log(3.0)}  # token 0 banned; token 3 three times as likely
    n = 4000
    params = SamplingParams(temperature=1.0, logit_bias=bias)
    out = Sampler()(logits.expand(n, -1), [row(params) for _ in range(n)])
    observed = np.bincount(out.token_ids, minlength=4)
    expected = torch.softmax(reference_adjusted(logits[None], [params], [[]])[0], dim=-1).numpy() * n
    assert observed[0] == 0
    chi2 = float(((observed[1:] - expected[1:]) ** 2 / expected[1:]).sum())
    assert chi2 < 2 + 6 * math.sqrt(4) + 10, (observed, expected)


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 20)
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={7: 100}), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, [row(p) for p in params])
    assert out.token_ids[0] == 7 and out.token_ids[1] == int(logits[1].argmax())
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(raw[7].item(), abs=1e-5)
    assert [t for t, _ in out.logprobs[0].top] == raw.topk(3).indices.tolist()


@pytest.mark.parametrize("bias", [{-1: 1.0}, {1: 100.5}, {1: float("nan")}, {True: 1.0}, {"5": 1.0}, [1, 2]])
def test_malformed_bias_is_a_value_error_naming_the_field(bias) -> None:
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams(logit_bias=bias)


# ---- through the engine, against HF transformers -----------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_greedy_with_bias(hf_model, prompt: list[int], steps: int, bias: dict[int, float]) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].double()
        for token, b in bias.items():
            logits[token] += b
        out.append(int(logits.argmax()))
    return out


def test_engine_output_matches_hf_with_the_same_bias(tiny: LLM, hf_tiny) -> None:
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [unbiased] = tiny.generate([PROMPT], [plain])
    first = unbiased.outputs[0].token_ids
    # ban what the model would say, favour two other tokens a little: the argmax moves, not to a fixed token
    bias = {first[0]: -100.0, first[1]: -100.0, 11: 4.0, 200: 2.5}
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    outs = tiny.generate([PROMPT, PROMPT], [biased, plain])  # the unbiased neighbour in the batch is untouched
    assert outs[1].outputs[0].token_ids == first
    tokens = outs[0].outputs[0].token_ids
    assert tokens == hf_greedy_with_bias(hf_tiny, PROMPT, 8, bias)
    assert first[0] not in tokens and first[1] not in tokens


def test_token_outside_the_vocabulary_is_refused_before_anything_runs(tiny: LLM) -> None:
    vocab = tiny.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"^logit_bias: token id {vocab} is outside"):
        tiny.generate([PROMPT], [SamplingParams(max_tokens=2, logit_bias={vocab: 1.0})])
    assert not tiny.engine.requests


@pytest.mark.gpu
def test_bias_on_the_gpu_equals_the_cpu_reference() -> None:
    torch.manual_seed(4)
    logits = torch.randn(64, 32_000, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logit_bias={int(t): float(b) for t, b in zip(
        torch.randint(0, 32_000, (i % 5,)), torch.empty(i % 5).uniform_(-100, 100))} or None) for i in range(64)]
    on_gpu = add_logit_bias(logits.cuda(), params)
    torch.testing.assert_close(on_gpu.cpu(), reference_adjusted(logits, params, [[]] * 64).float(), rtol=0, atol=1e-4)
    wide = torch.randn(64, 32_000)  # float32: no ties for the argmax to break differently
    picked = Sampler()(wide.cuda(), [row(p) for p in params]).token_ids
    assert picked == reference_adjusted(wide, params, [[]] * 64).argmax(dim=-1).tolist()
