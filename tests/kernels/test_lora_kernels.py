"""The LoRA shrink / expand kernels (SGMV for prefill, BGMV for decode) against the PyTorch reference, on mixed
batches: several adapters, base-model tokens between them, fused projections of several slices."""

import numpy as np
import pytest
import torch

import kernels
from kernels import reference
from kernels.lora_indices import lora_indices
from tests.kernels.helpers import poisoned_outputs, rel_err, replayed_in_a_graph, tolerance

pytest.importorskip("triton")
from kernels.punica_expand import bgmv_expand_, bgmv_expand_silu_and_mul, sgmv_expand_  # noqa: E402
from kernels.punica_shrink import bgmv_shrink, sgmv_shrink  # noqa: E402


def _stacks(num_slots: int, rank: int, k: int, slice_widths: list[int], dtype, device):
    a = torch.randn(num_slots, len(slice_widths) * rank, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(num_slots, sum(slice_widths), rank, device=device, dtype=dtype)
    offsets = [0] + np.cumsum(slice_widths).tolist()
    return a, b, offsets, torch.tensor(offsets, dtype=torch.int32, device=device)


def _prefill_slots(lengths_and_slots: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.full(n, s, dtype=np.int32) for n, s in lengths_and_slots])


# sequences of several lengths: two adjacent ones of one adapter, base-model ones between, a long one
PREFILL = [(5, 2), (3, 2), (17, -1), (1, 0), (40, 3), (2, -1), (9, 1)]


@pytest.mark.parametrize("rank,slice_widths,k", [(8, [48, 16, 16], 40), (16, [70], 130), (4, [33, 33], 64)])
def test_sgmv_matches_reference_on_a_mixed_prefill(device, rank, slice_widths, k) -> None:
    torch.manual_seed(0)
    slots = _prefill_slots(PREFILL)
    a, b, offsets, offsets_t = _stacks(4, rank, k, slice_widths, torch.float32, device)
    x = torch.randn(slots.size, k, device=device)
    indices = lora_indices(slots, device, one_token_per_seq=False)
    token_slots = indices.token_slots
    with poisoned_outputs():
        shrunk = sgmv_shrink(x, a, indices)
    expected = reference.lora_shrink(x, a, token_slots)
    lora_rows = torch.from_numpy(slots >= 0).to(device)
    assert rel_err(shrunk[lora_rows], expected[lora_rows]) < 1e-4
    y = torch.randn(slots.size, offsets[-1], device=device)
    y_ref = y.clone()
    sgmv_expand_(y, expected, b, indices, offsets_t, offsets, rank)
    reference.lora_expand_(y_ref, expected, b, token_slots, offsets, rank)
    assert rel_err(y, y_ref) < 1e-5
    assert torch.equal(y[~lora_rows], y_ref[~lora_rows])  # base-model rows untouched


@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_bgmv_matches_reference_on_a_mixed_decode(device, num_tokens, fused_norm) -> None:
    torch.manual_seed(1)
    rank, k, widths = 16, 300, [64, 32, 32]
    slots = np.array([3, -1, 0, 3, 1, -1, 2][:num_tokens], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(4, rank, k, widths, torch.float32, device)
    x = torch.randn(num_tokens, k, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-5) if fused_norm else None
    indices = lora_indices(slots, device, one_token_per_seq=True)
    with poisoned_outputs():  # the partial sums of base-model rows are never written: the expand must skip them
        shrunk = bgmv_shrink(x, a, indices, split_k=3, norm=norm)
        assert shrunk.partials.shape[0] == 2  # 300 inputs in splits of 256
        normed = x if norm is None else reference.rms_norm(x, *norm)
        expected = reference.lora_shrink(normed, a, indices.token_slots)
        lora_rows = torch.from_numpy(slots >= 0).to(device)
        assert rel_err(shrunk.rows()[lora_rows], expected[lora_rows]) < 1e-4
        y = torch.randn(num_tokens, offsets[-1], device=device)
        y_ref = y.clone()
        bgmv_expand_(y, shrunk, b, indices, offsets_t, offsets, rank)
    reference.lora_expand_(y_ref, expected, b, indices.token_slots, offsets, rank)
    assert rel_err(y, y_ref) < 1e-5
    assert torch.equal(y[~lora_rows], y_ref[~lora_rows])  # base-model rows untouched


def test_lora_add_dispatch_equals_dense_per_token_math(device) -> None:
    """kernels.lora_add_ (the op the engine calls) against each token's dense x A^T B^T."""
    torch.manual_seed(2)
    rank, k, widths = 8, 48, [32, 16]
    a, b, offsets, offsets_t = _stacks(3, rank, k, widths, torch.float32, device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-6)
    cases = [(np.array([2, -1, 0], dtype=np.int32), True), (_prefill_slots([(4, 1), (3, -1), (5, 2)]), False)]
    for (slots, decode), with_norm in [(case, with_norm) for case in cases for with_norm in (False, True)]:
        x = torch.randn(slots.size, k, device=device)
        y = torch.zeros(slots.size, offsets[-1], device=device)
        kernels.lora_add_(y, x, a, b, offsets_t, offsets, rank, lora_indices(slots, device, decode),
                          norm=norm if with_norm else None)
        if with_norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0]
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                assert not y[t].any()
                continue
            for i in range(len(widths)):
                dense = x[t] @ a[slot, i * rank:(i + 1) * rank].T @ b[slot, offsets[i]:offsets[i + 1]].T
                assert torch.allclose(y[t, offsets[i]:offsets[i + 1]], dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused_norm", [False, True])
def test_bgmv_expand_with_silu_equals_expand_then_silu(device, fused_norm) -> None:
    """The gate|up projection's decode form: its LoRA expand and the SiLU product in one kernel, base-model rows
    taking the product of the base output alone."""
    torch.manual_seed(4)
    rank, k, n = 8, 72, 40
    slots = np.array([1, -1, 0, 1, -1], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(2, rank, k, [n, n], torch.float32, device)
    x = torch.randn(slots.size, k, device=device)
    y = torch.randn(slots.size, 2 * n, device=device)
    norm = (torch.rand(k, device=device) + 0.5, 1e-5) if fused_norm else None
    indices = lora_indices(slots, device, one_token_per_seq=True)
    with poisoned_outputs():
        got = bgmv_expand_silu_and_mul(y, bgmv_shrink(x, a, indices, split_k=2, norm=norm), b, indices, rank)
    normed = x if norm is None else reference.rms_norm(x, *norm)
    y_ref = y.clone()
    reference.lora_expand_(y_ref, reference.lora_shrink(normed, a, indices.token_slots), b, indices.token_slots,
                           offsets, rank)
    assert rel_err(got, reference.silu_and_mul(y_ref)) < 1e-5
    dispatched = kernels.lora_add_silu_and_mul(y.clone(), x, a, b, offsets_t, offsets, rank, indices, norm=norm)
    assert rel_err(dispatched, reference.silu_and_mul(y_ref)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode,fused_norm", [(True, False), (True, True), (False, False), (False, True)])
def test_lora_kernels_gpu_bf16_llama_8b_shapes(decode, fused_norm) -> None:
    torch.manual_seed(3)
    rank, k, widths = 16, 4096, [4096, 1024, 1024]
    a, b, offsets, offsets_t = _stacks(16, rank, k, widths, torch.bfloat16, torch.device("cuda"))
    slots = (np.arange(64) % 17 - 1).astype(np.int32) if decode else _prefill_slots([(300, 3), (77, -1), (513, 15)])
    x = torch.randn(slots.size, k, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(slots.size, offsets[-1], device="cuda", dtype=torch.bfloat16)
    y_ref = y.float()
    norm = (torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5) if fused_norm else None
    kernels.lora_add_(y, x, a, b, offsets_t, offsets, rank, lora_indices(slots, torch.device("cuda"), decode),
                      norm=norm)
    normed = x.float() if norm is None else reference.rms_norm(x.float(), norm[0].float(), norm[1])
    shrunk = reference.lora_shrink(normed, a.float(), torch.from_numpy(slots).cuda())
    reference.lora_expand_(y_ref, shrunk, b.float(), torch.from_numpy(slots).cuda(), offsets, rank)
    assert rel_err(y, y_ref) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_decode_shrink_on_a_side_stream_then_expand_equals_lora_add(grouped: bool) -> None:
    """A decode step's two halves as the engine runs them on CUDA (engine/lora/projection.py): the shrink on a stream
    of its own beside a base product on the current one, the expand once the current stream has waited for it; in a
    CUDA graph replayed on new rows, against lora_add_ and the reference."""
    device = torch.device("cuda")
    torch.manual_seed(6)
    rank, k, widths = 16, 4096, [4096, 1024, 1024]
    slots = np.array([3, -1, 0, 3, 1, 3, 0, 2], dtype=np.int32)
    a, b, offsets, offsets_t = _stacks(4, rank, k, widths, torch.bfloat16, device)
    weight = (torch.randn(offsets[-1], k, device=device) / k**0.5).to(torch.bfloat16)
    norm = ((torch.rand(k, device=device) + 0.5).to(torch.bfloat16), 1e-5)
    x = torch.randn(slots.size, k, device=device, dtype=torch.bfloat16)
    indices = lora_indices(slots, device, one_token_per_seq=True, num_slots=4, grouped=grouped)
    side = torch.cuda.Stream(device)
    assert kernels.lora_decode_halves(x, indices)

    def step() -> torch.Tensor:
        shrunk = kernels.lora_shrink(x, a, indices, norm=norm, stream=side)
        y = kernels.linear(x, weight, norm=norm)  # the base product, meanwhile
        torch.cuda.current_stream(device).wait_stream(side)
        kernels.lora_expand_(y, shrunk, b, offsets_t, offsets, rank, indices)
        return y

    out = replayed_in_a_graph(step, lambda: x.copy_(torch.randn(slots.size, k, device=device)))
    y_add = kernels.linear(x, weight, norm=norm)
    kernels.lora_add_(y_add, x, a, b, offsets_t, offsets, rank, indices, norm=norm)
    assert rel_err(out, y_add) < 1e-2
    normed = reference.rms_norm(x.float(), norm[0].float(), norm[1])
    want = normed @ weight.float().T
    reference.lora_expand_(want, reference.lora_shrink(normed, a.float(), indices.token_slots), b.float(),
                           indices.token_slots, offsets, rank)
    assert rel_err(out, want) < 1e-2
