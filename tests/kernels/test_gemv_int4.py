"""The int4 decode GEMV in half2 arithmetic (kernels/gemv_int4.py) against dequantize-then-matmul in float32: random
odd sizes, every group size, bias, several rows, rows not 8-byte aligned, the gated epilogue; and kernels.int4_linear
through it on the GPU at Llama-3-8B's shapes, inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from kernels import formats, reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance
from tests.kernels.test_quant_linear import random_int4

pytest.importorskip("triton")
from kernels.gemv_configs import int4_gemv_config  # noqa: E402
from kernels.gemv_int4 import gemv_int4  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

SMALL = [GemvConfig(block_n=4, block_k=64, num_warps=2), GemvConfig(block_n=1, block_k=128, num_warps=1)]


def expected(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int,
             bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), reference.dequantize_int4(q, s, z, group_size, torch.float32),
                    None if bias is None else bias.float())


@pytest.mark.parametrize(("m", "n", "k", "group_size"),
                         [(1, 37, 192, 32), (3, 16, 256, 128), (2, 9, 64, 64), (1, 5, 40, 8), (1, 12, 640, 128)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gemv_int4_matches_reference(device: torch.device, m: int, n: int, k: int, group_size: int,
                                     config: GemvConfig) -> None:
    q, s, z = random_int4(n, k, group_size, device)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with poisoned_outputs():
        out = gemv_int4(x, q, s, z, group_size, bias, config=config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # the bf16 output's rounding, and the activations rounded to float16 for the half2 products
    assert rel_err(out, expected(x, q, s, z, group_size, bias)) < 8e-3


def test_gemv_int4_decodes_every_nibble_exactly(device: torch.device) -> None:
    """One-hot rows of x pick single weights: every nibble value at every position within a word, minus its group's
    zero point, comes back exact."""
    k, group_size = 64, 16
    q = torch.arange(16, device=device).repeat(8, k // 16)
    for row in range(8):
        q[row] = q[row].roll(row * 3)
    z = torch.randint(0, 17, (8, k // group_size), dtype=torch.uint8, device=device)
    s = torch.ones(8, k // group_size, device=device)
    x = torch.eye(k, device=device, dtype=torch.bfloat16)
    out = gemv_int4(x, formats.pack_int4(q), s, z, group_size, config=SMALL[0])
    assert torch.equal(out.float(), (q.float() - z.float().repeat_interleave(group_size, dim=1)).T)


def test_gemv_int4_unaligned_and_leading_dims(device: torch.device) -> None:
    q, s, z = random_int4(10, 128, 32, device)
    storage = torch.randn(2 * 128 + 1, device=device, dtype=torch.bfloat16)
    x = storage[1:].view(2, 1, 128)  # 2 bytes past an 8-byte boundary: read through an aligned copy
    out = gemv_int4(x, q, s, z, 32, config=SMALL[1])
    assert out.shape == (2, 1, 10)
    assert rel_err(out, expected(x.reshape(2, 128), q, s, z, 32, None).view(2, 1, 10)) < 8e-3


@pytest.mark.parametrize(("m", "n", "k"), [(1, 2 * 13, 256), (2, 2 * 6, 128)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gated_gemv_int4_equals_gemv_then_silu(device: torch.device, m: int, n: int, k: int,
                                               config: GemvConfig) -> None:
    from kernels.activation import silu_and_mul

    q, s, z = random_int4(n, k, 64, device)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with poisoned_outputs():
        out = gemv_int4(x, q, s, z, 64, bias, config=config, gated=True)
    assert out.shape == (m, n // 2)
    assert torch.equal(out, silu_and_mul(gemv_int4(x, q, s, z, 64, bias, config=config)))
    assert rel_err(out, reference.silu_and_mul(expected(x, q, s, z, 64, bias))) < 2e-2
    with pytest.raises(ValueError, match="even number of rows"):
        gemv_int4(x, q[:-1].contiguous(), s[:-1].contiguous(), z[:-1].contiguous(), 64, config=config, gated=True)


def test_gemv_int4_rejects_bad_inputs(device: torch.device) -> None:
    q, s, z = random_int4(6, 96, 32, device)
    x = torch.randn(1, 96, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 rows of 96"):
        gemv_int4(x.float(), q, s, z, 32, config=SMALL[0])
    with pytest.raises(ValueError, match="power-of-two group size"):
        gemv_int4(x, q, s[:, :2], z[:, :2], 48, config=SMALL[0])
    with pytest.raises(ValueError, match="scales"):
        gemv_int4(x, q, s[:5], z, 32, config=SMALL[0])
    with pytest.raises(ValueError, match="uint8"):
        gemv_int4(x, q, s, z.to(torch.int32), 32, config=SMALL[0])
    assert gemv_int4(x[:0], q, s, z, 32, config=SMALL[0]).shape == (0, 6)


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096), (4096, 2048), (4096, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_int4_linear_gpu_one_row_in_graph(n: int, k: int) -> None:
    """kernels.int4_linear at Llama-3-8B's shapes (whole and TP = 2 halves) with int8_activations=False (else one row
    runs kernels/gemv_int4_a8.py, tests/kernels/test_gemv_int4_a8.py): one bf16 row runs this GEMV with the shipped
    configuration, captured in a CUDA graph and replayed on new activations; gated too."""
    import kernels

    q, s, z = random_int4(n, k, 128, torch.device("cuda"))
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kernels.int4_linear(x, q, s, z, 128, bias, int8_activations=False)  # compiles outside the capture
    kernels.int4_linear(x, q, s, z, 128, bias, gated=True, int8_activations=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.int4_linear(x, q, s, z, 128, bias, int8_activations=False)
        gated = kernels.int4_linear(x, q, s, z, 128, bias, gated=True, int8_activations=False)
    x.normal_()
    graph.replay()
    ref = expected(x, q, s, z, 128, bias)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    assert rel_err(gated, reference.silu_and_mul(ref)) < tolerance(torch.bfloat16)
    assert torch.equal(out, gemv_int4(x, q, s, z, 128, bias, config=int4_gemv_config(n, k)))
