"""The int8 decode GEMV that decodes weights by bit operations (kernels/gemv_int.py) against dequantize-then-matmul
in float32, on random odd sizes, with bias, several rows and rows that are not 8-byte aligned; and
the engine's int8 path (kernels.int8_linear) through it on the GPU, inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.gemv_configs import gemv_config  # noqa: E402
from kernels.gemv_int import gemv_int8  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

SMALL = [GemvConfig(block_n=4, block_k=64, num_warps=2), GemvConfig(block_n=1, block_k=128, num_warps=1)]


def int8_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # the full int8 range, -128 included: the sign-flip decoding must get both ends right
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device), torch.rand(n, device=device) * 0.01


def expected(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), reference.dequantize_int8(q, scales, torch.float32),
                    None if bias is None else bias.float())


@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 200), (3, 64, 128), (2, 24, 452)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gemv_int8_matches_reference(device: torch.device, m: int, n: int, k: int, config: GemvConfig) -> None:
    q, scales = int8_weight(n, k, device)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with poisoned_outputs():
        out = gemv_int8(x, q, scales, bias, config=config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # the bf16 output's rounding (the interpreter truncates rather than rounds: up to 2**-8)
    assert rel_err(out, expected(x, q, scales, bias)) < 8e-3


def test_gemv_int8_decodes_every_byte_exactly(device: torch.device) -> None:
    """One-hot rows of x pick single weights: every byte value at every position within a word comes back exact.
    One row of x per byte position (bytes 0-3 of four different int32 words), 256 weight rows holding each value
    once in that column: 4 x 256 weights checked, as 256 x 8 were, in 1/8 of the interpreter's work."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (256, 64), dtype=torch.int8, generator=generator)
    picked = [4 * word + position for position, word in enumerate((0, 5, 10, 15))]
    for i, column in enumerate(picked):
        q[:, column] = torch.arange(-128, 128, dtype=torch.int8).roll(37 * i)
    q = q.to(device)
    x = torch.eye(64, device=device, dtype=torch.bfloat16)[picked]
    out = gemv_int8(x, q, torch.ones(256, device=device), config=SMALL[0])
    assert torch.equal(out.float(), q[:, picked].float().T)


def test_gemv_int8_unaligned_and_leading_dims(device: torch.device) -> None:
    q, scales = int8_weight(10, 64, device)
    storage = torch.randn(2 * 64 + 1, device=device, dtype=torch.bfloat16)
    x = storage[1:].view(2, 1, 64)  # 2 bytes past an 8-byte boundary: read through an aligned copy
    out = gemv_int8(x, q, scales, config=SMALL[1])
    assert out.shape == (2, 1, 10)
    assert rel_err(out, expected(x.reshape(2, 64), q, scales, None).view(2, 1, 10)) < 8e-3


@pytest.mark.parametrize(("m", "n", "k"), [(1, 2 * 37, 200), (2, 2 * 12, 452)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gated_gemv_int8_equals_gemv_then_silu(device: torch.device, m: int, n: int, k: int, config: GemvConfig) -> None:
    """gated=True: silu(gate) * up of a fused [gate; up] int8 weight, bit for bit the plain GEMV then the SiLU kernel."""
    from kernels.activation import silu_and_mul

    q, scales = int8_weight(n, k, device)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with poisoned_outputs():
        out = gemv_int8(x, q, scales, bias, config=config, gated=True)
    assert out.shape == (m, n // 2)
    assert torch.equal(out, silu_and_mul(gemv_int8(x, q, scales, bias, config=config)))
    assert rel_err(out, reference.silu_and_mul(expected(x, q, scales, bias))) < 2e-2
    with pytest.raises(ValueError, match="even number of rows"):
        gemv_int8(x, q[:-1].contiguous(), scales[:-1], config=config, gated=True)


def test_gemv_int8_rejects_bad_inputs(device: torch.device) -> None:
    q, scales = int8_weight(6, 32, device)
    with pytest.raises(ValueError, match="bf16 rows of 32"):
        gemv_int8(torch.randn(1, 32, device=device), q, scales, config=SMALL[0])
    with pytest.raises(ValueError, match="bf16 rows of 32"):
        gemv_int8(torch.randn(1, 31, device=device, dtype=torch.bfloat16), q, scales, config=SMALL[0])
    with pytest.raises(ValueError, match="not a multiple of 4"):
        gemv_int8(torch.randn(1, 30, device=device, dtype=torch.bfloat16), q[:, :30].contiguous(), scales,
                  config=SMALL[0])
    with pytest.raises(ValueError, match="scales"):
        gemv_int8(torch.randn(1, 32, device=device, dtype=torch.bfloat16), q, scales[:5], config=SMALL[0])
    assert gemv_int8(torch.randn(0, 32, device=device, dtype=torch.bfloat16), q, scales,
                     config=SMALL[0]).shape == (0, 6)


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 7168), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
def test_int8_linear_gpu_one_row_in_graph(n: int, k: int) -> None:
    """kernels.int8_linear at Llama-3-8B's shapes (the LM head last): one bf16 row runs this GEMV with the shipped
    configuration, captured in a CUDA graph and replayed on new activations."""
    import kernels

    q, scales = int8_weight(n, k, torch.device("cuda"))
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kernels.int8_linear(x, q, scales, bias)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.int8_linear(x, q, scales, bias)
    x.normal_()
    graph.replay()
    assert rel_err(out, expected(x, q, scales, bias)) < tolerance(torch.bfloat16)
    direct = gemv_int8(x, q, scales, bias, config=gemv_config(n, k, 1, torch.int8))
    assert torch.equal(out, direct)
