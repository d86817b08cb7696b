"""The dense LoRA expand (kernels/punica_dense.py: each token's shrunk row placed in its slot's columns, then one GEMM
per slice against every slot's B) against the PyTorch reference, over the grouped kernels' slot layouts, with and
without the fused norm, float32 and bfloat16; and at the 8B's shapes on the GPU through the ops the engine calls,
its rows made on the shrink's side stream, in a CUDA graph."""

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.lora_indices import lora_indices
from tests.kernels.helpers import poisoned_outputs, rel_err, replayed_in_a_graph, tolerance
from tests.kernels.test_lora_grouped_kernels import LAYOUTS, NUM_SLOTS, _expected_rows

pytest.importorskip("triton")
from kernels.punica_dense import dense_expand_, dense_rows  # noqa: E402
from kernels.punica_shrink import bgmv_shrink, grouped_shrink  # noqa: E402


def _rank_major_stacks(num_slots: int, rank: int, k: int, slice_widths: list[int], dtype, device):
    """a [S, slices * rank, K]; b [S, N, rank] as the slot pool holds it: a transposed view of [S, rank, N]."""
    a = (torch.randn(num_slots, len(slice_widths) * rank, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(num_slots, rank, sum(slice_widths), device=device).to(dtype).transpose(1, 2)
    offsets = [0] + np.cumsum(slice_widths).tolist()
    return a, b, offsets, torch.tensor(offsets, dtype=torch.int32, device=device)


def _scattered(rows: torch.Tensor, slots: np.ndarray, num_slots: int, rank: int) -> torch.Tensor:
    """The rows dense_rows must write: token t's ranks of slice i at [t, i, slot * rank:(slot + 1) * rank]."""
    num_slices = rows.shape[1] // rank
    out = torch.zeros(rows.shape[0], num_slices, num_slots, rank, dtype=rows.dtype, device=rows.device)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t, :, slot] = rows[t].view(num_slices, rank)
    return out.view(rows.shape[0], num_slices, num_slots * rank)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rank,fused_norm", [(8, True), (16, False), (64, True)])
def test_dense_rows_place_each_tokens_shrunk_row_in_its_slots_columns(device, layout, rank, fused_norm) -> None:
    torch.manual_seed(rank)
    k, widths = 160, [48, 16]
    slots = np.array(LAYOUTS[layout], dtype=np.int32)
    a, _, _, _ = _rank_major_stacks(NUM_SLOTS, rank, k, widths, torch.float32, device)
    x = torch.randn(slots.size, k, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-5) if fused_norm else None
    indices = lora_indices(slots, device, one_token_per_seq=True, num_slots=NUM_SLOTS, grouped=True, dense=True)
    with poisoned_outputs():  # every element is written, and base-model rows' unwritten partials are never read
        rows = dense_rows(grouped_shrink(x, a, indices, split_k=2, norm=norm), indices, NUM_SLOTS, rank,
                          torch.float32).rows
    want = _scattered(_expected_rows(x, a, indices.token_slots, norm), slots, NUM_SLOTS, rank)
    assert rows.shape == (slots.size, len(widths), NUM_SLOTS * rank)
    assert not rows.isnan().any()
    assert rel_err(rows, want) < 1e-5
    assert torch.count_nonzero(rows[torch.from_numpy(slots < 0).to(device)]) == 0


@pytest.mark.parametrize("layout", ["base-rows-between", "unused-slots", "slot-over-a-block"])
@pytest.mark.parametrize("widths", [[40], [24, 24]])
def test_dense_expand_matches_reference(device, layout, widths) -> None:
    torch.manual_seed(5)
    rank, k = 8, 72
    slots = np.array(LAYOUTS[layout], dtype=np.int32)
    a, b, offsets, _ = _rank_major_stacks(NUM_SLOTS, rank, k, widths, torch.float32, device)
    x = torch.randn(slots.size, k, device=device)
    indices = lora_indices(slots, device, one_token_per_seq=True, num_slots=NUM_SLOTS, grouped=True, dense=True)
    y = torch.randn(slots.size, offsets[-1], device=device)
    y_ref = y.clone()
    dense_expand_(y, dense_rows(bgmv_shrink(x, a, indices), indices, NUM_SLOTS, rank, torch.float32), b, offsets)
    reference.lora_expand_(y_ref, _expected_rows(x, a, indices.token_slots, None), b, indices.token_slots, offsets,
                           rank)
    assert rel_err(y, y_ref) < 1e-5
    base_rows = torch.from_numpy(slots < 0).to(device)
    assert torch.equal(y[base_rows], y_ref[base_rows])  # zeros added: base-model rows keep their values


def test_dense_form_in_bfloat16_matches_float32_reference(device) -> None:
    torch.manual_seed(9)
    rank, k, widths = 16, 200, [64, 64]
    slots = np.array(LAYOUTS["base-rows-between"], dtype=np.int32)
    a, b, offsets, _ = _rank_major_stacks(NUM_SLOTS, rank, k, widths, torch.bfloat16, device)
    x = torch.randn(slots.size, k, device=device, dtype=torch.bfloat16)
    y = torch.randn(slots.size, offsets[-1], device=device, dtype=torch.bfloat16)
    norm = (torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5, 1e-5)
    indices = lora_indices(slots, device, one_token_per_seq=True, num_slots=NUM_SLOTS, grouped=True, dense=True)
    y_ref = y.float()
    rows = dense_rows(grouped_shrink(x, a, indices, norm=norm), indices, NUM_SLOTS, rank, torch.bfloat16)
    dense_expand_(y, rows, b, offsets)
    reference.lora_expand_(y_ref, _expected_rows(x, a, indices.token_slots, norm), b.float(), indices.token_slots,
                           offsets, rank)
    assert rel_err(y, y_ref) < tolerance(torch.bfloat16)


def test_dense_expand_refuses_b_stacks_not_stored_rank_major(device) -> None:
    rank, widths = 8, [16]
    b = torch.randn(NUM_SLOTS, sum(widths), rank, device=device)  # [S, N, rank] contiguous: the grouped kernels' own
    x, a = torch.randn(3, 8, device=device), torch.randn(NUM_SLOTS, rank, 8, device=device)
    indices = lora_indices(np.array([0, 1, 2], dtype=np.int32), device, True, num_slots=NUM_SLOTS, grouped=True,
                           dense=True)
    rows = dense_rows(grouped_shrink(x, a, indices), indices, NUM_SLOTS, rank, torch.float32)
    with pytest.raises(ValueError, match="rank-major"):
        dense_expand_(torch.zeros(3, 16, device=device), rows, b, [0, 16])


def test_dense_indices_need_the_grouped_form() -> None:
    with pytest.raises(ValueError, match="grouped decode steps only"):
        lora_indices(np.array([0, 1], dtype=np.int32), torch.device("cpu"), True, num_slots=2, dense=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group", ["o", "gate_up", "down", "qkv"])
def test_dense_lora_ops_gpu_bf16_llama_8b_shapes_on_a_side_stream_in_a_graph(group: str) -> None:
    """kernels.lora_shrink / lora_expand_ / lora_expand_silu_and_mul with dense indices, as engine/lora/projection.py
    calls them: 64 decode tokens over 16 slots with base-model rows among them, the rows made on the side stream
    beside the base product (and NaN-filled allocations on the current stream meanwhile), in a CUDA graph replayed on
    new inputs; q|k|v keeps the grouped expand."""
    import kernels

    torch.manual_seed(11)
    cuda = torch.device("cuda")
    rank = 16
    k, widths = {"o": (4096, [4096]), "gate_up": (4096, [14336, 14336]), "down": (14336, [4096]),
                 "qkv": (4096, [4096, 1024, 1024])}[group]
    a, b, offsets, offsets_t = _rank_major_stacks(16, rank, k, widths, torch.bfloat16, cuda)
    weight = (torch.randn(offsets[-1], k, device=cuda) / k**0.5).to(torch.bfloat16)
    slots = (np.arange(64) % 17 - 1).astype(np.int32)
    indices = lora_indices(slots, cuda, one_token_per_seq=True, num_slots=16, grouped=True, dense=True)
    assert kernels.lora_dense_expand(indices, offsets) is (group != "qkv")
    x = torch.randn(64, k, device=cuda, dtype=torch.bfloat16)
    side = torch.cuda.Stream(cuda)
    dense_rank = rank if kernels.lora_dense_expand(indices, offsets) else None

    def step() -> torch.Tensor:
        shrunk = kernels.lora_shrink(x, a, indices, stream=side, dense_rank=dense_rank)
        for numel in (2**p for p in range(8, 21)):  # memory the shrink's stream may still read must not come back
            torch.full((numel,), float("nan"), device=cuda)
        y = x @ weight.T
        torch.cuda.current_stream(cuda).wait_stream(side)
        if group == "gate_up":
            return kernels.lora_expand_silu_and_mul(y, shrunk, b, offsets_t, offsets, rank, indices)
        kernels.lora_expand_(y, shrunk, b, offsets_t, offsets, rank, indices)
        return y

    out = replayed_in_a_graph(step, lambda: x.copy_(torch.randn(64, k, device=cuda)))
    want = x.float() @ weight.float().T
    reference.lora_expand_(want, _expected_rows(x, a, indices.token_slots, None), b.float(), indices.token_slots,
                           offsets, rank)
    if group == "gate_up":
        want = reference.silu_and_mul(want)
    assert rel_err(out, want) < tolerance(torch.bfloat16)
