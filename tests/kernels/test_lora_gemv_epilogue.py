"""The batch-1 LoRA expand in the decode GEMV's epilogue (kernels/lora_epilogue.py) against the PyTorch reference: the
base product of the (normed) row plus its adapter's LoRA term (shrink, then expand, kernels/reference.py), then the
residual or the gate's SiLU product; fused projections of several slices whose boundaries fall inside a program's
rows, ranks below the rank block, base-model tokens (no term), and a mismatched term refused."""

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.lora_indices import lora_indices
from tests.kernels.helpers import poisoned_outputs, rel_err

pytest.importorskip("triton")
from kernels.gemv import gemv  # noqa: E402
from kernels.lora_epilogue import LoRATerm  # noqa: E402
from kernels.punica_shrink import bgmv_shrink  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

EPS = 1e-5
CONFIG = GemvConfig(block_n=8, block_k=64, num_warps=2)


def case(device: torch.device, slot: int, rank: int, widths: list[int], k: int, norm: bool, seed: int):
    """(x [1, K], weight [N, K], norm, LoRATerm, the reference's (normed row, shrunk row, stacks, offsets))."""
    torch.manual_seed(seed)
    n = sum(widths)
    x = torch.randn(1, k, device=device)
    weight = torch.randn(n, k, device=device) / k**0.5
    a = torch.randn(3, len(widths) * rank, k, device=device) / k**0.5
    b = torch.randn(3, n, rank, device=device)
    offsets = [0] + np.cumsum(widths).tolist()
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    fused = (torch.rand(k, device=device) + 0.5, EPS) if norm else None
    indices = lora_indices(np.array([slot], dtype=np.int32), device, one_token_per_seq=True)
    term = LoRATerm(bgmv_shrink(x, a, indices, split_k=2, norm=fused), b, indices, offsets_t, offsets, rank)
    row = x if fused is None else reference.rms_norm(x, *fused)
    return x, weight, fused, term, (row, a, b, indices.token_slots, offsets)


def expected(weight: torch.Tensor, rank: int, ref) -> torch.Tensor:
    row, a, b, slots, offsets = ref
    out = row @ weight.T
    reference.lora_expand_(out, reference.lora_shrink(row, a, slots), b, slots, offsets, rank)
    return out


@pytest.mark.parametrize(("slot", "rank", "widths", "k", "norm"), [
    (2, 16, [24, 12, 12], 192, True),   # q|k|v: slices of 24, 12, 12 rows in programs of 8 rows
    (0, 8, [21, 7, 7], 130, False),     # slice boundaries inside programs, K not a multiple of the block
    (1, 5, [40], 256, True),            # one slice, a rank below the rank block
    (-1, 16, [24, 12, 12], 192, True),  # a base-model token: the plain product
])
def test_the_term_is_added_to_the_product(device: torch.device, slot: int, rank: int, widths: list[int], k: int,
                                          norm: bool) -> None:
    x, weight, fused, term, ref = case(device, slot, rank, widths, k, norm, seed=rank + k)
    with poisoned_outputs():
        got = gemv(x, weight, config=CONFIG, norm=fused, lora=term)
    want = expected(weight, rank, ref) if slot >= 0 else ref[0] @ weight.T
    assert rel_err(got, want) < 1e-5
    if slot >= 0:
        assert rel_err(got, ref[0] @ weight.T) > 1e-2  # the term changed the outputs


def test_the_residual_comes_after_the_term(device: torch.device) -> None:
    x, weight, fused, term, ref = case(device, 1, 8, [36], 128, False, seed=7)
    residual = torch.randn(1, 36, device=device) * 10
    got = gemv(x, weight, config=CONFIG, residual=residual, lora=term)
    assert rel_err(got, expected(weight, 8, ref) + residual) < 1e-5


@pytest.mark.parametrize("norm", [False, True])
def test_the_gate_sees_the_term(device: torch.device, norm: bool) -> None:
    """gate|up: the term of each half is added before silu(gate) * up."""
    x, weight, fused, term, ref = case(device, 0, 16, [28, 28], 160, norm, seed=11)
    with poisoned_outputs():
        got = gemv(x, weight, config=CONFIG, gated=True, norm=fused, lora=term)
    assert rel_err(got, reference.silu_and_mul(expected(weight, 16, ref))) < 1e-5


def test_a_term_shrunk_without_the_projections_norm_is_refused(device: torch.device) -> None:
    x, weight, fused, term, _ = case(device, 0, 8, [24], 64, False, seed=3)
    with pytest.raises(ValueError, match="without the norm"):
        gemv(x, weight, config=CONFIG, norm=(torch.ones(64, device=device), EPS), lora=term)
    with pytest.raises(ValueError, match="LoRA term over 24 rows"):
        gemv(x, torch.randn(16, 64, device=device), config=CONFIG, lora=term)


@pytest.mark.gpu
@pytest.mark.parametrize(("widths", "k", "gated", "norm"), [
    ([4096, 1024, 1024], 4096, False, True),  # q|k|v
    ([4096], 4096, False, False),             # o, with the residual
    ([14336, 14336], 4096, True, True),       # gate|up
    ([4096], 14336, False, False),            # down, with the residual
])
def test_the_engines_ops_at_llama_8b_shapes_in_a_graph(widths: list[int], k: int, gated: bool, norm: bool) -> None:
    """kernels.linear / linear_silu_and_mul with a term from kernels.lora_term (what a batch-1 decode step with an
    adapter runs: the shrink, then the GEMV with the expand), bf16, rank 16, captured in a CUDA graph and replayed on a
    new row, against the float32 reference."""
    import kernels

    device, rank, n = torch.device("cuda"), 16, sum(widths)
    torch.manual_seed(5)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    a = (torch.randn(4, len(widths) * rank, k, device=device) / k**0.5).to(torch.bfloat16)
    b = (torch.randn(4, n, rank, device=device) * 0.1).to(torch.bfloat16)
    offsets = [0] + np.cumsum(widths).tolist()
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    fused = ((torch.rand(k, device=device) + 0.5).to(torch.bfloat16), EPS) if norm else None
    residual = None if gated else torch.randn(1, n, device=device, dtype=torch.bfloat16)
    indices = lora_indices(np.array([3], dtype=np.int32), device, one_token_per_seq=True)
    assert kernels.lora_into_gemv(x, weight, indices)

    def run() -> torch.Tensor:
        term = kernels.lora_term(x, a, b, offsets_t, offsets, rank, indices, norm=fused)
        if gated:
            return kernels.linear_silu_and_mul(x, weight, norm=fused, lora=term)
        return kernels.linear(x, weight, norm=fused, residual=residual, lora=term)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn(1, k, device=device))
    graph.replay()
    row = x.float() if fused is None else reference.rms_norm(x.float(), fused[0].float(), EPS)
    want = row @ weight.float().T
    reference.lora_expand_(want, reference.lora_shrink(row, a.float(), indices.token_slots), b.float(),
                           indices.token_slots, offsets, rank)
    want = reference.silu_and_mul(want) if gated else want + residual.float()
    assert rel_err(out, want) < 1e-2
