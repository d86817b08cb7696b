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
