"""The two-pass argmax (kernels/row_argmax.py) against torch.argmax: random rows of odd widths over several chunks, ties
within and across chunks, rows of -inf and NaN, bf16 and float32; and through kernels.argmax at the LM head's
width on the GPU."""

import pytest
import torch

pytest.importorskip("triton")
from kernels.row_argmax import argmax  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 37), (2, 1000), (5, 1027)])
def test_argmax_matches_torch(device: torch.device, dtype: torch.dtype, rows: int, vocab: int) -> None:
    x = torch.randn(rows, vocab, device=device).to(dtype)
    assert torch.equal(argmax(x, chunk=256).cpu(), x.float().argmax(dim=-1).cpu())


def test_argmax_ties_go_to_the_lowest_index(device: torch.device) -> None:
    x = torch.zeros(4, 700, device=device)
    x[0, [5, 600]] = 3.0  # across chunks
    x[1, [300, 301]] = 3.0  # within one chunk
    x[2] = float("-inf")  # every entry -inf: index 0
    x[3, [650, 10]] = torch.tensor([2.0, 2.0], device=device)
    assert argmax(x, chunk=256).tolist() == [5, 300, 0, 10]


def test_argmax_counts_nan_as_largest(device: torch.device) -> None:
    x = torch.randn(2, 600, device=device)
    x[0, 450] = float("nan")
    x[1, 3] = float("inf")
    got = argmax(x, chunk=256).tolist()
    assert got == [450, 3] and got[0] == x.cpu().argmax(dim=-1)[0].item()


def test_argmax_strided_rows_and_bad_inputs(device: torch.device) -> None:
    base = torch.randn(3, 900, device=device)
    view = base[:, ::2]
    assert torch.equal(argmax(view, chunk=128).cpu(), view.argmax(dim=-1).cpu())
    assert argmax(torch.empty(0, 5, device=device)).shape == (0,)
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.randn(5, device=device))
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.empty(2, 0, device=device))


@pytest.mark.gpu
def test_kernels_argmax_at_the_lm_head_width() -> None:
    import kernels

    logits = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    logits[3, 128255] = 100.0  # the last entry of the last, partial chunk
    got = kernels.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))


def _shards(full: torch.Tensor, num_shards: int) -> list[tuple[torch.Tensor, int, int]]:
    """(real columns, offset, width) of each shard, the vocabulary split as VocabParallelEmbedding splits it."""
    width = -(-full.shape[1] // num_shards)
    return [(full[:, r * width: (r + 1) * width], r * width, width) for r in range(num_shards)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "num_shards"), [(1, 5000, 1), (4, 9001, 2), (3, 12289, 3)])
def test_shard_candidates_pick_the_argmax(device: torch.device, dtype: torch.dtype, rows: int, vocab: int,
                                          num_shards: int) -> None:
    """argmax_candidates of each shard, stacked and picked, give torch.argmax of the whole row; the candidates
    equal the PyTorch reference's."""
    from kernels import reference
    from kernels.row_argmax import argmax_candidates, pick_argmax_candidate

    full = torch.randn(rows, vocab, device=device).to(dtype)
    full[0, [7, vocab - 1]] = 9.0  # a tie between the first and the last shard
    if rows > 1:
        full[1] = float("-inf")
    stacked = []
    for part, offset, width in _shards(full, num_shards):
        got = argmax_candidates(part, offset, width)
        torch.testing.assert_close(got.cpu(), reference.argmax_candidates(part.cpu(), offset, width), rtol=0, atol=0)
        stacked.append(got)
    picked = pick_argmax_candidate(torch.stack(stacked))
    assert picked.dtype == torch.int64 and torch.equal(picked.cpu(), full.float().argmax(dim=-1).cpu())
    assert torch.equal(reference.pick_argmax_candidate(torch.stack(stacked).cpu()), picked.cpu())


def test_shard_candidates_count_nan_as_largest_and_check_inputs(device: torch.device) -> None:
    from kernels.row_argmax import argmax_candidates, pick_argmax_candidate

    full = torch.randn(2, 8200, device=device)
    full[0, 6000] = float("nan")
    full[1, 8199] = 40.0
    stacked = torch.stack([argmax_candidates(p, o, w) for p, o, w in _shards(full, 2)])
    assert pick_argmax_candidate(stacked).tolist() == [6000, 8199]
    with pytest.raises(ValueError, match="width"):
        argmax_candidates(full, 0, 100)
    with pytest.raises(ValueError, match="2\\^24"):
        argmax_candidates(full, 1 << 24, 8200)
    with pytest.raises(ValueError, match="candidates"):
        pick_argmax_candidate(stacked[0])


@pytest.mark.gpu
def test_shard_candidates_at_the_lm_head_width() -> None:
    """Two shards of Llama-3's 128,256-token vocabulary (16 chunks each, the second's last one partial), bf16 rows
    with ties across the shards and within a chunk, against torch.argmax of the whole rows."""
    import kernels

    full = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    full[1, [100, 64128 + 5]] = 30.0  # across the shards
    full[2, [70000, 70001]] = 30.0  # within a chunk of the second shard
    full[3, 128255] = 30.0  # the last column
    full[4] = float("-inf")
    width = 128256 // 2
    stacked = torch.stack([kernels.argmax_candidates(full[:, r * width: (r + 1) * width], r * width, width)
                           for r in range(2)])
    got = kernels.pick_argmax_candidate(stacked)
    assert got.dtype == torch.int64 and torch.equal(got, full.float().argmax(dim=-1))
    assert got[1:4].tolist() == [100, 70000, 128255]


def _masks(gen: torch.Generator, num_masks: int, vocab: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random allowed sets packed as llguidance writes them, `words` wide (narrower than the vocabulary bans the
    rest), and the same as bool [K, V]."""
    allowed = torch.rand(num_masks, words * 32, generator=gen) < 0.1
    packed = (allowed.view(num_masks, words, 32).long() << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    full = torch.zeros(num_masks, vocab, dtype=torch.bool)
    full[:, :min(vocab, words * 32)] = allowed[:, :vocab]
    return packed, full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "words"), [(4, 37, 2), (6, 1000, 32), (5, 1027, 30), (3, 700, 40)])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(device, dtype, rows, vocab, words) -> None:
    """Against the logits masked bit by bit and torch.argmax (and the reference op): rows without a mask, masks in
    any order, masks narrower than the vocabulary; the logits are not written."""
    from kernels import reference
    from kernels.row_argmax import masked_argmax

    gen = torch.Generator().manual_seed(rows * vocab + words)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    packed, allowed = _masks(gen, 2, vocab, words)
    mask_of_row = torch.full((rows,), -1, dtype=torch.int32)
    mask_of_row[rows - 1], mask_of_row[0] = 0, 1
    expected = logits.float().clone()
    for row in range(rows):
        if mask_of_row[row] >= 0:
            expected[row] = expected[row].masked_fill(~allowed[mask_of_row[row]], float("-inf"))
    before = logits.clone()
    got = masked_argmax(logits.to(device), packed.to(device), mask_of_row.to(device), chunk=256)
    assert torch.equal(got.cpu(), expected.argmax(dim=-1))
    assert torch.equal(reference.masked_argmax(logits, packed, mask_of_row), expected.argmax(dim=-1))
    assert torch.equal(logits, before)


def test_masked_argmax_bans_nan_and_checks_its_inputs(device) -> None:
    from kernels.row_argmax import masked_argmax

    logits = torch.randn(2, 600, device=device)
    logits[:, 450] = float("nan")  # largest, unless the mask bans it
    words = torch.zeros(1, 19, dtype=torch.int32)
    words[0, 3] = 1 << 5  # token 101 alone
    mask_of_row = torch.tensor([0, -1], dtype=torch.int32, device=device)
    assert masked_argmax(logits, words.to(device), mask_of_row, chunk=256).tolist() == [101, 450]
    with pytest.raises(ValueError, match="mask_of_row"):
        masked_argmax(logits, words.to(device), mask_of_row.long())
    with pytest.raises(ValueError, match="words"):
        masked_argmax(logits, words.to(device).long(), mask_of_row)


@pytest.mark.gpu
def test_kernels_masked_argmax_at_the_lm_head_width() -> None:
    import kernels

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128256, generator=gen).to(torch.bfloat16)
    packed, _ = _masks(gen, 32, 128256, 4008)
    mask_of_row = torch.full((64,), -1, dtype=torch.int32)
    mask_of_row[::2] = torch.arange(32, dtype=torch.int32)
    expected = logits.float().clone()
    rows = torch.arange(0, 64, 2)
    kernels.reference.apply_token_bitmask_(expected, packed, rows)
    got = kernels.masked_argmax(logits.cuda(), packed.cuda(), mask_of_row.cuda())
    assert torch.equal(got.cpu(), expected.argmax(dim=-1))
