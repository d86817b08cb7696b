"""The rejection sampler against the distributions it must reproduce, on an 8-token vocabulary.

Many independent sequences go through one call (each row of the batch is one draw); the seeds are fixed,
so the test is deterministic, and the bounds sit several standard errors above the sampling noise while
far below the gap a sampler returning the draft's distribution would show (asserted too)."""

import math

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import processed_probs
from engine.spec_decode.rejection_sampler import rejection_sample

V = 8
DRAWS = 40_000
K = 2


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's statistic against its 0.1% critical value (Wilson-Hilferty); tokens of probability 0 must not occur."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    expected = probs[support] * counts.sum()
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = 3.09  # the 99.9th percentile of the standard normal
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical


def setup(params: SamplingParams, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, V, generator=gen) * 1.5  # target logits after the last token and each draft
    draft_logits = torch.randn(K, V, generator=gen) * 1.5
    p = processed_probs(logits, [params] * (K + 1))
    q = processed_probs(draft_logits, [SamplingParams(temperature=1.0)] * K)
    return logits, p, q, gen


def run(logits, draft_tokens, draft_probs, params, seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    n = len(draft_tokens)
    return rejection_sample(
        logits.repeat(n, 1), [i * (K + 1) for i in range(n)], draft_tokens, draft_probs, [params] * n, [None] * n
    )


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_draft_model_proposals_keep_the_target_distribution(params):
    logits, p, q, gen = setup(params, seed=1)
    # the draft proposes d0 ~ q0, then d1 ~ q1 (its distribution does not depend on d0 here, nor does the target's)
    d0 = torch.multinomial(q[0], DRAWS, replacement=True, generator=gen)
    d1 = torch.multinomial(q[1], DRAWS, replacement=True, generator=gen)
    drafts = torch.stack([d0, d1], dim=1).tolist()
    out = run(logits, drafts, [q] * DRAWS, params, seed=2)

    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float()
    assert chi_square_ok(first, p[0])
    assert total_variation(first, p[0]) < 0.015
    # the test has power: the draft's own distribution is far from the target's
    assert 0.5 * float((q[0] - p[0]).abs().sum()) > 0.1

    # the first draft was kept exactly when the first token equals it; then the second token follows p1
    second = torch.bincount(torch.tensor([o[1] for o, d in zip(out, drafts) if o[0] == d[0]]), minlength=V).float()
    assert second.sum() > 5000
    assert chi_square_ok(second, p[1])
    assert total_variation(second, p[1]) < 0.025
    # and a third (bonus) token comes from p2 when both drafts were kept
    third = torch.bincount(torch.tensor([o[2] for o, d in zip(out, drafts) if o[:2] == d]), minlength=V).float()
    assert third.sum() > 300
    assert chi_square_ok(third, p[2])

    kept = sum(len(o) - 1 for o in out) / DRAWS
    # expected number of kept drafts: sum over i of prod_{j<=i} sum_x min(p_j, q_j)
    alpha = torch.minimum(p[:K], q).sum(dim=1)
    assert kept == pytest.approx(float(alpha[0] + alpha[0] * alpha[1]), abs=0.02)


def test_deterministic_proposals_keep_the_target_distribution():
    """n-gram proposals: q is one-hot, the draft is kept with probability p(d)."""
    params = SamplingParams(temperature=0.9, min_p=0.05)
    logits, p, _, _ = setup(params, seed=3)
    draft = [int(p[0].argsort(descending=True)[1]), int(p[1].argmax())]  # the runner-up first, then the favourite
    out = run(logits, [draft] * DRAWS, [None] * DRAWS, params, seed=4)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float()
    assert chi_square_ok(first, p[0])
    assert total_variation(first, p[0]) < 0.015
    assert 0.1 < float(p[0, draft[0]]) < 0.5  # a guess that is often right and often wrong
    second = torch.bincount(torch.tensor([o[1] for o in out if o[0] == draft[0]]), minlength=V).float()
    assert chi_square_ok(second, p[1])


def test_greedy_rows_keep_drafts_up_to_the_first_disagreement():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2 * (K + 1), V, generator=gen)
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    all_right = [best[0], best[1]]
    wrong_second = [best[3], (best[4] + 1) % V]
    out = rejection_sample(logits, [0, K + 1], [all_right, wrong_second], [None, None], [greedy] * 2, [None] * 2)
    assert out == [[best[0], best[1], best[2]], [best[3], best[4]]]


def test_seeded_rows_draw_from_their_own_generators():
    params = SamplingParams(temperature=1.0, seed=7)
    logits, _, q, _ = setup(params, seed=6)
    drafts = [[1, 2]] * 64

    def draw(seed_offset: int) -> list[list[int]]:
        torch.manual_seed(seed_offset)  # the global generator must not matter for seeded rows
        gens = [torch.Generator().manual_seed(100 + i) for i in range(64)]
        return rejection_sample(logits.repeat(64, 1), [i * (K + 1) for i in range(64)], drafts, [q] * 64,
                                [params] * 64, gens)

    assert draw(0) == draw(1)
