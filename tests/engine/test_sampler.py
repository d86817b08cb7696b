"""Sampler: support of top-k / top-p / min-p, sampling frequencies, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.config import SamplingParams
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingRow, apply_penalties, suppress_tokens

PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005])
LOGITS = torch.tensor(np.log(PROBS), dtype=torch.float32)
N_SAMPLES = 4000
fast = settings(max_examples=25, deadline=None)


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        device: str = "cpu") -> SamplingRow:
    generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
    return SamplingRow(params, prompt or [], output or [], generator)


def sample_many(logits: torch.Tensor, params: SamplingParams, n: int = N_SAMPLES) -> np.ndarray:
    out = Sampler()(logits.expand(n, -1), [row(params) for _ in range(n)])
    return np.array(out.token_ids)


def hand_support(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Token ids kept by top-k, then top-p, then min-p, computed with plain numpy."""
    order = np.argsort(-probs, kind="stable")
    kept = order[:top_k] if top_k > 0 else order
    renormalised = probs[kept] / probs[kept].sum()
    n_keep = int(np.searchsorted(np.cumsum(renormalised), top_p)) + 1 if top_p < 1.0 else len(kept)
    kept = kept[:n_keep]
    return kept[probs[kept] >= min_p * probs[kept].max()]


def assert_frequencies(samples: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit; the bound is well above the 0.999 quantile for these degrees of freedom."""
    expected = probs / probs.sum() * len(samples)
    observed = np.bincount(samples, minlength=len(probs))
    assert observed[expected == 0].sum() == 0
    nonzero = expected > 0
    chi2 = float((((observed - expected) ** 2)[nonzero] / expected[nonzero]).sum())
    dof = max(int(nonzero.sum()) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, observed, expected)


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(3, 1.0, 0.0), (0, 0.7, 0.0), (-1, 1.0, 0.25), (5, 0.9, 0.0), (6, 0.8, 0.3), (1, 1.0, 0.0)],
)
def test_filters_stay_in_support_and_match_renormalised_distribution(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(0)
    support = hand_support(PROBS, top_k, top_p, min_p)
    samples = sample_many(LOGITS, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p))
    assert set(samples.tolist()) <= set(support.tolist())
    renormalised = np.zeros_like(PROBS)
    renormalised[support] = PROBS[support]
    assert_frequencies(samples, renormalised)


@fast
@given(
    weights=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=12),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_pick_outside_support(weights: list[float], top_k: int, top_p: float, min_p: float) -> None:
    probs = np.array(weights) / sum(weights)
    ordered = np.sort(probs)[::-1]
    # Keep away from ties and from thresholds that float32 rounding could tip either way.
    assume(np.all(np.diff(ordered) < -1e-4))
    kept = ordered[:top_k] if top_k > 0 else ordered
    assume(top_p == 1.0 or np.all(np.abs(np.cumsum(kept / kept.sum()) - top_p) > 1e-4))
    assume(np.all(np.abs(probs - min_p * probs.max()) > 1e-4))
    support = hand_support(probs, top_k, top_p, min_p)
    samples = sample_many(torch.tensor(np.log(probs), dtype=torch.float32),
                          SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p), n=300)
    assert set(samples.tolist()) <= set(support.tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    torch.manual_seed(1)
    samples = sample_many(LOGITS, SamplingParams(temperature=temperature))
    assert_frequencies(samples, torch.softmax(LOGITS / temperature, dim=-1).double().numpy())


@fast
@given(st.lists(st.lists(st.floats(-20, 20), min_size=7, max_size=7), min_size=1, max_size=6))
def test_greedy_equals_argmax(values: list[list[float]]) -> None:
    logits = torch.tensor(values, dtype=torch.float32)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in values])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def seeded_run(seed: int, position: int, batch_size: int, steps: int = 12) -> list[int]:
    """Tokens a seeded row gets over several steps, placed at `position` among other random rows."""
    logits = torch.log(torch.full((10,), 0.1))
    target = row(SamplingParams(seed=seed, temperature=1.0))
    others = [row(SamplingParams(seed=1000 + i if i % 2 else None, top_k=5)) for i in range(batch_size - 1)]
    tokens = []
    for _ in range(steps):
        batch = others[:position] + [target] + others[position:]
        out = Sampler()(logits.expand(batch_size, -1), batch)
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    reference = seeded_run(seed=42, position=0, batch_size=1)
    assert seeded_run(seed=42, position=0, batch_size=5) == reference
    assert seeded_run(seed=42, position=3, batch_size=4) == reference
    assert seeded_run(seed=42, position=6, batch_size=7) == reference
    assert seeded_run(seed=43, position=2, batch_size=3) != reference


def test_seeded_row_ignores_global_rng_and_other_rows_logits() -> None:
    torch.manual_seed(5)
    first = Sampler()(LOGITS.unsqueeze(0), [row(SamplingParams(seed=7))]).token_ids
    torch.manual_seed(6)
    mixed_logits = torch.stack([torch.randn(10), LOGITS, torch.randn(10)])
    rows = [row(SamplingParams()), row(SamplingParams(seed=7)), row(SamplingParams(temperature=0.0))]
    assert Sampler()(mixed_logits, rows).token_ids[1] == first[0]


PENALTY_LOGITS = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])
PROMPT = [0, 1, 5]
OUTPUT = [1, 2, 2, 3]


@pytest.mark.parametrize(
    "params,expected",
    [
        # repetition: tokens in prompt or output (0, 1, 2, 3, 5): positive / p, negative * p
        (SamplingParams(repetition_penalty=2.0), [0.5, 1.0, -2.0, 0.25, 3.0, -4.0]),
        # frequency: output counts only (1: 1, 2: 2, 3: 1); prompt-only tokens 0 and 5 untouched
        (SamplingParams(frequency_penalty=0.5), [1.0, 1.5, -2.0, 0.0, 3.0, -2.0]),
        # presence: once per token seen in the output
        (SamplingParams(presence_penalty=0.25), [1.0, 1.75, -1.25, 0.25, 3.0, -2.0]),
        (SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0), [1.0, 1.5, -1.0, 0.0, 3.0, -2.0]),
        (SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
         [0.5, 0.25, -3.25, -0.5, 3.0, -4.0]),
        (SamplingParams(), [1.0, 2.0, -1.0, 0.5, 3.0, -2.0]),
    ],
)
def test_apply_penalties_by_hand(params: SamplingParams, expected: list[float]) -> None:
    original = PENALTY_LOGITS.clone()
    adjusted = apply_penalties(PENALTY_LOGITS, [row(params, PROMPT, OUTPUT)])
    torch.testing.assert_close(adjusted, torch.tensor([expected]))
    assert torch.equal(PENALTY_LOGITS, original)


def test_penalties_are_per_row() -> None:
    logits = PENALTY_LOGITS.expand(3, -1)
    rows = [row(SamplingParams(), PROMPT, OUTPUT), row(SamplingParams(frequency_penalty=0.5), PROMPT, OUTPUT),
            row(SamplingParams(presence_penalty=0.25), [], [])]
    adjusted = apply_penalties(logits, rows)
    torch.testing.assert_close(adjusted[0], PENALTY_LOGITS[0])
    torch.testing.assert_close(adjusted[1], torch.tensor([1.0, 1.5, -2.0, 0.0, 3.0, -2.0]))
    torch.testing.assert_close(adjusted[2], PENALTY_LOGITS[0])


def test_penalties_change_greedy_picks() -> None:
    sampler = Sampler()
    greedy = dict(temperature=0.0)
    # token 4 (3.0) repeated three times: 3.0 - 3 * 0.5 = 1.5 < token 1's 2.0
    out = sampler(PENALTY_LOGITS, [row(SamplingParams(frequency_penalty=0.5, **greedy), [], [4, 4, 4])])
    assert out.token_ids == [1]
    # in the prompt only: frequency and presence ignore it, repetition does not (3.0 / 4 = 0.75 < 2.0)
    assert sampler(PENALTY_LOGITS, [row(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, **greedy),
                                        [4, 4, 4], [])]).token_ids == [4]
    assert sampler(PENALTY_LOGITS, [row(SamplingParams(repetition_penalty=4.0, **greedy), [4], [])]).token_ids == [1]


@fast
@given(
    values=st.lists(st.floats(-5, 5), min_size=6, max_size=6),
    prompt=st.lists(st.integers(0, 5), max_size=8),
    output=st.lists(st.integers(0, 5), max_size=8),
    repetition=st.floats(0.5, 2.0),
    frequency=st.floats(-2.0, 2.0),
    presence=st.floats(-2.0, 2.0),
)
def test_apply_penalties_matches_reference_loop(values: list[float], prompt: list[int], output: list[int],
                                                repetition: float, frequency: float, presence: float) -> None:
    params = SamplingParams(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence)
    expected = []
    for token, logit in enumerate(values):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = output.count(token)
        expected.append(logit - count * frequency - (count > 0) * presence)
    adjusted = apply_penalties(torch.tensor([values]), [row(params, prompt, output)])
    torch.testing.assert_close(adjusted, torch.tensor([expected]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [0, 1, 3, 10, 20])
def test_logprobs_match_raw_log_softmax(k: int) -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 10)
    params = [SamplingParams(logprobs=k, temperature=0.7, repetition_penalty=1.5, top_k=2),
              SamplingParams(logprobs=k, temperature=0.0, frequency_penalty=2.0),
              SamplingParams(logprobs=k, seed=3)]
    out = Sampler()(logits, [row(p, [0, 1], [2, 3]) for p in params])
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    for i, lp in enumerate(out.logprobs):
        assert isinstance(lp, TokenLogprob)
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == min(k, 10)
        top_values = [v for _, v in lp.top]
        assert top_values == sorted(top_values, reverse=True)
        expected_ids = reference[i].argsort(descending=True)[: len(lp.top)].tolist()
        assert [t for t, _ in lp.top] == expected_ids
        for token, value in lp.top:
            assert value == pytest.approx(reference[i, token].item(), abs=1e-5)


def test_mixed_batch_counts_and_types() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 32, dtype=torch.bfloat16)
    original = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9), SamplingParams(seed=11, top_k=4),
              SamplingParams(logprobs=2, min_p=0.1), SamplingParams(temperature=0.0, logprobs=0)]
    out = Sampler()(logits, [row(p, [1, 2], [3]) for p in params])
    assert len(out.token_ids) == 5 and all(type(t) is int and 0 <= t < 32 for t in out.token_ids)
    assert out.token_ids[0] == logits[0].float().argmax().item()
    assert out.token_ids[4] == logits[4].float().argmax().item()
    assert out.logprobs is not None and len(out.logprobs) == 5
    assert out.logprobs[:3] == [None, None, None]
    assert isinstance(out.logprobs[3], TokenLogprob) and len(out.logprobs[3].top) == 2
    assert isinstance(out.logprobs[4], TokenLogprob) and out.logprobs[4].top == []
    assert all(type(lp.logprob) is float for lp in out.logprobs[3:] if lp is not None)
    assert torch.equal(logits, original)


def test_suppress_tokens_forbids_them() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0], [5.0, 0.0, 1.0]])
    suppress_tokens(logits, {0: [1], 1: {0, 2}})
    assert logits[0, 1] == float("-inf") and logits[1, 0] == float("-inf") and logits[1, 2] == float("-inf")
    assert logits[0, 0] == 0.0 and logits[1, 1] == 0.0
    suppress_tokens(logits, {})
    out = Sampler()(logits.expand(2, -1).repeat(200, 1), [row(SamplingParams()) for _ in range(400)])
    assert 1 not in out.token_ids[0::2] and set(out.token_ids[1::2]) == {1}


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 4), [row(SamplingParams())])


def test_exact_thresholds_keep_boundary_tokens() -> None:
    torch.manual_seed(4)
    uniform = torch.zeros(4)  # probabilities of exactly 0.25
    # top_p = 0.5: two tokens reach the mass exactly, a third is not needed
    assert len(set(sample_many(uniform, SamplingParams(top_p=0.5), n=400).tolist())) == 2
    # min_p = 1: every token whose probability equals the maximum stays
    assert set(sample_many(uniform, SamplingParams(min_p=1.0), n=400).tolist()) == {0, 1, 2, 3}
    assert set(sample_many(LOGITS, SamplingParams(min_p=1.0), n=100).tolist()) == {0}


def _bitmask(num_rows: int, vocab: int, masked_rows: list[int], seed: int):
    from engine.token_mask import TokenBitmask

    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(len(masked_rows), -(-vocab // 32) * 32, generator=gen) < 0.2
    packed = (allowed.view(len(masked_rows), -1, 32).long() << torch.arange(32)).sum(-1)
    words = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    mask_of_row = torch.full((num_rows,), -1, dtype=torch.int32)
    mask_of_row[masked_rows] = torch.arange(len(masked_rows), dtype=torch.int32)
    return TokenBitmask(torch.tensor(masked_rows), words, mask_of_row), allowed[:, :vocab]


def test_a_greedy_batchs_masks_pick_the_argmax_of_the_allowed_tokens_and_leave_the_logits() -> None:
    """Every row plain greedy: one masked argmax, the logits untouched; the tokens are those of masking by hand."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    bitmask, allowed = _bitmask(5, 300, [3, 0], seed=2)
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), ()) for _ in range(5)]
    before = logits.clone()
    tokens = Sampler().token_tensor(logits, rows, bitmask).tolist()
    by_hand = before.clone()
    by_hand[3] = by_hand[3].masked_fill(~allowed[0], float("-inf"))
    by_hand[0] = by_hand[0].masked_fill(~allowed[1], float("-inf"))
    assert tokens == by_hand.argmax(dim=-1).tolist() and torch.equal(logits, before)


def test_masks_with_logprobs_mask_the_logits_the_logprobs_are_taken_over() -> None:
    """A row asking for logprobs: the masks go into the logits first, so its logprob is over the allowed tokens."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    bitmask, allowed = _bitmask(2, 300, [1], seed=4)
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), ()),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=5), (), ())]
    out = Sampler()(logits, rows, bitmask)
    masked = before[1].masked_fill(~allowed[0], float("-inf"))
    assert out.token_ids == [int(before[0].argmax()), int(masked.argmax())]
    assert out.logprobs[1].logprob == pytest.approx(float(torch.log_softmax(masked, -1)[out.token_ids[1]]), abs=1e-5)
    assert torch.equal(logits[1], masked) and torch.equal(logits[0], before[0])
