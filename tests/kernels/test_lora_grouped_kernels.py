"""The grouped LoRA decode kernels (a step's tokens sorted by adapter slot, a grid over the slot pool: each adapter's
A and B read once a step) against the PyTorch reference, over slot layouts: every token in one slot, every token in
its own, base-model rows between them, slots no token uses, more tokens in a slot than one block of rows; ranks
8 / 16 / 64, fused projections, the fused RMSNorm and SiLU product, float32 and bfloat16."""

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.lora_indices import group_rows, lora_indices
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.punica_expand import (  # noqa: E402
    bgmv_expand_,
    bgmv_expand_silu_and_mul,
    grouped_expand_,
    grouped_expand_silu_and_mul,
)
from kernels.punica_shrink import bgmv_shrink, grouped_shrink  # noqa: E402

NUM_SLOTS = 5
LAYOUTS = {  # name -> each token's slot in a pool of NUM_SLOTS (-1: the base model)
    "one-slot": [2] * 6,
    "own-slots": [4, 0, 3, 1, 2],
    "base-rows-between": [3, -1, 0, 3, -1, 1, 3, -1, 0],
    "unused-slots": [4, 1, 4, 4, 1],
    "only-base-rows": [-1, -1, -1],
    "slot-over-a-block": [1] * 18 + [-1, 0, 1],  # 19 rows of slot 1: two blocks of 16
}


def _stacks(rank: int, k: int, slice_widths: list[int], dtype):
    device = _device()
    a = (torch.randn(NUM_SLOTS, len(slice_widths) * rank, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(NUM_SLOTS, sum(slice_widths), rank, device=device).to(dtype)
    offsets = [0] + np.cumsum(slice_widths).tolist()
    return a, b, offsets, torch.tensor(offsets, dtype=torch.int32, device=device)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _grouped(slots: np.ndarray):
    return lora_indices(slots, _device(), one_token_per_seq=True, num_slots=NUM_SLOTS, grouped=True)


def _expected_rows(x, a, slots_t, norm):
    normed = x.float() if norm is None else reference.rms_norm(x.float(), norm[0].float(), norm[1])
    return reference.lora_shrink(normed, a.float(), slots_t)


def test_rows_are_grouped_by_slot_in_token_order_with_base_rows_last():
    order, starts = group_rows(np.array([3, -1, 0, 3, -1, 1], dtype=np.int32), num_slots=5)
    assert order.tolist() == [2, 5, 0, 3, 1, 4]
    assert starts.tolist() == [0, 1, 2, 2, 4, 4, 6]  # slots 0..4, then the base-model rows, then T
    with pytest.raises(ValueError, match="outside a pool of 5"):
        group_rows(np.array([5], dtype=np.int32), num_slots=5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_grouped_shrink_and_expand_match_reference(device, layout, rank) -> None:
    torch.manual_seed(rank)
    k, widths = 160, [48, 16, 16]
    slots = np.array(LAYOUTS[layout], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(rank, k, widths, torch.float32)
    x = torch.randn(slots.size, k, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-5) if rank != 16 else None
    indices = _grouped(slots)
    lora_rows = torch.from_numpy(slots >= 0).to(device)
    with poisoned_outputs():  # base-model rows' partial sums are never written: the expand must skip them
        shrunk = grouped_shrink(x, a, indices, split_k=2, norm=norm)
        assert shrunk.partials.shape[0] == 2
        expected = _expected_rows(x, a, indices.token_slots, norm)
        if lora_rows.any():
            assert rel_err(shrunk.rows()[lora_rows], expected[lora_rows]) < 1e-4
        y = torch.randn(slots.size, offsets[-1], device=device)
        y_ref = y.clone()
        grouped_expand_(y, shrunk, b, indices, offsets_t, offsets, rank)
    reference.lora_expand_(y_ref, expected, b, indices.token_slots, offsets, rank)
    assert rel_err(y, y_ref) < 1e-5
    assert torch.equal(y[~lora_rows], y_ref[~lora_rows])  # base-model rows untouched


@pytest.mark.parametrize("layout", ["base-rows-between", "slot-over-a-block", "only-base-rows"])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_grouped_expand_with_silu_writes_every_row_like_expand_then_silu(device, layout, fused_norm) -> None:
    """The gate|up projection's grouped form: slots' rows get their LoRA term on both halves before the product,
    base-model rows the product alone; every row of the output is written."""
    torch.manual_seed(4)
    rank, k, n = 8, 72, 40
    slots = np.array(LAYOUTS[layout], dtype=np.int32)
    a, b, offsets, _ = _stacks(rank, k, [n, n], torch.float32)
    x = torch.randn(slots.size, k, device=device)
    y = torch.randn(slots.size, 2 * n, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-5) if fused_norm else None
    indices = _grouped(slots)
    with poisoned_outputs():
        got = grouped_expand_silu_and_mul(y, grouped_shrink(x, a, indices, norm=norm), b, indices, rank)
    y_ref = y.clone()
    reference.lora_expand_(y_ref, _expected_rows(x, a, indices.token_slots, norm), b, indices.token_slots, offsets,
                           rank)
    assert rel_err(got, reference.silu_and_mul(y_ref)) < 1e-5


@pytest.mark.parametrize("layout", ["base-rows-between", "own-slots"])
def test_grouped_form_in_bfloat16_matches_float32_reference_and_bgmv(device, layout) -> None:
    torch.manual_seed(7)
    rank, k, widths = 16, 200, [64, 32, 32]
    slots = np.array(LAYOUTS[layout], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(rank, k, widths, torch.bfloat16)
    x = torch.randn(slots.size, k, device=device, dtype=torch.bfloat16)
    y = torch.randn(slots.size, offsets[-1], device=device, dtype=torch.bfloat16)
    norm = (torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5, 1e-5)
    indices = _grouped(slots)
    grouped_y, bgmv_y = y.clone(), y.clone()
    grouped_expand_(grouped_y, grouped_shrink(x, a, indices, norm=norm), b, indices, offsets_t, offsets, rank)
    bgmv_expand_(bgmv_y, bgmv_shrink(x, a, indices, norm=norm), b, indices, offsets_t, offsets, rank)
    y_ref = y.float()
    reference.lora_expand_(y_ref, _expected_rows(x, a, indices.token_slots, norm), b.float(), indices.token_slots,
                           offsets, rank)
    assert rel_err(grouped_y, y_ref) < tolerance(torch.bfloat16)
    assert rel_err(grouped_y, bgmv_y) < tolerance(torch.bfloat16)


def test_either_expand_reads_either_shrinks_partial_sums(device) -> None:
    """Both decode forms write the same SplitShrunk (split-K partial sums with the norm's sums of squares), so a
    grouped shrink feeds the per-token expand and the other way round."""
    torch.manual_seed(9)
    rank, k, n = 16, 300, 48
    slots = np.array(LAYOUTS["base-rows-between"], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(rank, k, [n, n], torch.float32)
    x = torch.randn(slots.size, k, device=device)
    y = torch.randn(slots.size, 2 * n, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-6)
    indices = _grouped(slots)
    grouped = grouped_shrink(x, a, indices, split_k=2, norm=norm)
    bgmv = bgmv_shrink(x, a, indices, split_k=2, norm=norm)
    assert grouped.partials.shape == bgmv.partials.shape
    lora_rows = torch.from_numpy(slots >= 0).to(device)
    assert rel_err(grouped.rows()[lora_rows], bgmv.rows()[lora_rows]) < 1e-5
    crossed = [bgmv_expand_silu_and_mul(y, grouped, b, indices, rank),
               grouped_expand_silu_and_mul(y, bgmv, b, indices, rank)]
    assert rel_err(crossed[0], crossed[1]) < 1e-5
    for shrunk in (grouped, bgmv):
        out = y.clone()
        grouped_expand_(out, shrunk, b, indices, offsets_t, offsets, rank)
        ref = y.clone()
        bgmv_expand_(ref, shrunk, b, indices, offsets_t, offsets, rank)
        assert rel_err(out, ref) < 1e-5


def test_grouped_kernels_refuse_indices_without_the_pools_grouping(device) -> None:
    a, b, offsets, offsets_t = _stacks(8, 32, [16], torch.float32)
    x = torch.randn(2, 32, device=device)
    per_token = lora_indices(np.array([0, 1], dtype=np.int32), device, one_token_per_seq=True)
    with pytest.raises(ValueError, match="grouped form of 5 slots"):
        grouped_shrink(x, a, per_token)
    other_pool = lora_indices(np.array([0, 1], dtype=np.int32), device, True, num_slots=3, grouped=True)
    with pytest.raises(ValueError, match="grouped form of 5 slots"):
        grouped_expand_(torch.zeros(2, 16, device=device), bgmv_shrink(x, a, other_pool), b, other_pool, offsets_t,
                        offsets, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_norm", [False, True])
@pytest.mark.parametrize("gate_up", [False, True])
def test_grouped_lora_ops_gpu_bf16_llama_8b_shapes(fused_norm, gate_up) -> None:
    """kernels.lora_add_ / lora_add_silu_and_mul with grouped indices at the 8B's shapes: 64 decode tokens over 16
    slots with base-model rows among them, against the float32 reference."""
    import kernels

    torch.manual_seed(3)
    cuda = torch.device("cuda")
    rank, k = 16, 4096
    widths = [14336, 14336] if gate_up else [4096, 1024, 1024]
    a = torch.randn(16, len(widths) * rank, k, device=cuda, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(16, sum(widths), rank, device=cuda, dtype=torch.bfloat16)
    offsets = [0] + np.cumsum(widths).tolist()
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=cuda)
    slots = (np.arange(64) % 17 - 1).astype(np.int32)
    indices = lora_indices(slots, cuda, one_token_per_seq=True, num_slots=16, grouped=True)
    x = torch.randn(64, k, device=cuda, dtype=torch.bfloat16)
    y = torch.randn(64, offsets[-1], device=cuda, dtype=torch.bfloat16)
    norm = (torch.rand(k, device=cuda, dtype=torch.bfloat16) + 0.5, 1e-5) if fused_norm else None
    y_ref = y.float()
    reference.lora_expand_(y_ref, _expected_rows(x, a, indices.token_slots, norm), b.float(), indices.token_slots,
                           offsets, rank)
    if gate_up:
        got = kernels.lora_add_silu_and_mul(y.clone(), x, a, b, offsets_t, offsets, rank, indices, norm=norm)
        assert rel_err(got, reference.silu_and_mul(y_ref)) < tolerance(torch.bfloat16)
    else:
        kernels.lora_add_(y, x, a, b, offsets_t, offsets, rank, indices, norm=norm)
        assert rel_err(y, y_ref) < tolerance(torch.bfloat16)
