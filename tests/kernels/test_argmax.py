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
