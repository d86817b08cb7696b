"""Structured outputs' mask kernel (kernels/token_bitmask.py) against its reference and against a mask unpacked bit by
bit: only the listed rows change, banned tokens become -inf, allowed ones keep their value; widths that are not a
multiple of 32 or of the block, masks narrower than the vocabulary, bf16 and float32."""

import pytest
import torch

from kernels import reference

pytest.importorskip("triton")
from kernels.token_bitmask import apply_token_bitmask_  # noqa: E402


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [K, V] -> int32 [K, ceil(V / 32)], bit j of word w for token 32 * w + j (llguidance's layout)."""
    k, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(k, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(k, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "vocab", "rows"), [(1, 31, [0]), (5, 1000, [4, 0, 2]), (6, 4099, [1, 5]),
                                                          (3, 8200, [0, 1, 2])])
def test_masked_rows_match_the_reference_and_the_bits(device, dtype, num_rows, vocab, rows) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    allowed[:, -1] = True  # the last, partial word
    words = pack(allowed)
    index = torch.tensor(rows, dtype=torch.int64)

    expected = logits.clone()
    reference.apply_token_bitmask_(expected, words, index)
    for k, row in enumerate(rows):
        assert torch.equal(expected[row], logits[row].masked_fill(~allowed[k], float("-inf")))
    untouched = [r for r in range(num_rows) if r not in rows]
    assert torch.equal(expected[untouched], logits[untouched])

    got = logits.to(device)
    apply_token_bitmask_(got, words.to(device), index.to(device))
    assert torch.equal(got.cpu(), expected)


def test_tokens_past_the_mask_are_banned_and_empty_rows_are_a_no_op(device) -> None:
    logits = torch.zeros(2, 100, device=device)
    words = torch.full((1, 2), -1, dtype=torch.int32, device=device)  # 64 tokens allowed, 36 past the mask
    apply_token_bitmask_(logits, words, torch.tensor([1], device=device))
    assert torch.isinf(logits[1, 64:]).all() and (logits[1, :64] == 0).all() and (logits[0] == 0).all()
    apply_token_bitmask_(logits, words[:0], torch.empty(0, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, words.long(), torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="one words row per row index"):
        apply_token_bitmask_(logits, words, torch.tensor([0, 1], device=device))


@pytest.mark.gpu
def test_kernels_op_at_the_lm_head_width() -> None:
    import kernels

    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16)
    allowed = torch.rand(32, 128256) < 0.01
    rows = torch.arange(0, 64, 2)
    expected = logits.clone()
    reference.apply_token_bitmask_(expected, pack(allowed).cuda(), rows.cuda())
    got = logits.clone()
    kernels.apply_token_bitmask_(got, pack(allowed).cuda(), rows.cuda())
    assert torch.equal(got, expected) and torch.equal(got[1::2], logits[1::2])
