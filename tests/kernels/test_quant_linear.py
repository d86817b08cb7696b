"""The int8 / int4 weight-only linear kernels against the PyTorch dequantize-then-matmul references."""

import pytest
import torch

import kernels
from kernels import formats, reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.int4_matmul import dequantize_int4, int4_linear  # noqa: E402
from kernels.int8_matmul import int8_linear  # noqa: E402
from kernels.quant_linear_config import GemmConfig, GemvConfig  # noqa: E402

SMALL_GEMV = GemvConfig(block_n=4, block_k=64, num_warps=4)
SMALL_GEMM = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
# M <= 4: GEMV; 4 < M <= 64: GEMM; above: dequantize + F.linear
SMALL_LIMITS = dict(gemv=SMALL_GEMV, gemm=SMALL_GEMM, max_gemv_m=4, max_gemm_m=64)


def random_int4(n: int, k: int, group_size: int, device: torch.device):
    q = torch.randint(0, 16, (n, k), device=device)
    scales = torch.rand(n, k // group_size, device=device) * 0.05 + 1e-3
    zeros = torch.randint(0, 17, (n, k // group_size), dtype=torch.uint8, device=device)  # GPTQ v1 zeros reach 16
    return formats.pack_int4(q), scales, zeros


def test_pack_int4_round_trip() -> None:
    values = torch.randint(0, 16, (5, 48))
    values[0, 7] = 15  # the sign bit of an int32 word
    assert torch.equal(formats.unpack_int4(formats.pack_int4(values)), values)


@pytest.mark.parametrize("m", [1, 3, 11, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear(device: torch.device, m: int, with_bias: bool) -> None:
    n, k = 37, 200
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scales = torch.rand(n, device=device) * 0.01 + 1e-4
    bias = torch.randn(n, device=device) if with_bias else None
    x = torch.randn(m, k, device=device)
    with poisoned_outputs():
        out = int8_linear(x, qweight, scales, bias, **SMALL_LIMITS)
    assert rel_err(out, reference.int8_linear(x, qweight, scales, bias)) < 1e-5


@pytest.mark.parametrize("m", [1, 3, 11, 70])
def test_int8_linear_gated(device: torch.device, m: int) -> None:
    """gated=True on a fused [gate; up] weight: silu(gate) * up through every path (GEMV epilogue, GEMM then the SiLU
    kernel, dequantize + F.linear then the SiLU kernel)."""
    n, k = 2 * 19, 200
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scales = torch.rand(n, device=device) * 0.01 + 1e-4
    bias = torch.randn(n, device=device)
    x = torch.randn(m, k, device=device)
    with poisoned_outputs():
        out = int8_linear(x, qweight, scales, bias, gated=True, **SMALL_LIMITS)
    assert out.shape == (m, n // 2)
    assert rel_err(out, reference.silu_and_mul(reference.int8_linear(x, qweight, scales, bias))) < 1e-5


@pytest.mark.parametrize("m", [1, 3, 11, 70])
@pytest.mark.parametrize(("n", "k", "group_size"), [(29, 192, 32), (16, 256, 128), (9, 64, 64)])
def test_int4_linear(device: torch.device, m: int, n: int, k: int, group_size: int) -> None:
    qweight, scales, zeros = random_int4(n, k, group_size, device)
    bias = torch.randn(n, device=device)
    x = torch.randn(m, k, device=device)
    with poisoned_outputs():
        out = int4_linear(x, qweight, scales, zeros, group_size, bias, **SMALL_LIMITS)
    assert rel_err(out, reference.int4_linear(x, qweight, scales, zeros, group_size, bias)) < 1e-5


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.bfloat16), (1, torch.float32), (3, torch.float32),
                                          (11, torch.float32), (70, torch.float32)])
def test_int4_linear_gated(device: torch.device, m: int, dtype: torch.dtype) -> None:
    """gated=True on a fused [gate; up] int4 weight through every path: the half2 GEMV's epilogue (one bf16 row),
    the float32 GEMV, the GEMM, or dequantize + F.linear, then the SiLU kernel."""
    n, k = 2 * 13, 256
    qweight, scales, zeros = random_int4(n, k, 64, device)
    bias = torch.randn(n, device=device)
    x = torch.randn(m, k, device=device).to(dtype)
    with poisoned_outputs():
        out = int4_linear(x, qweight, scales, zeros, 64, bias.to(dtype), gated=True, **SMALL_LIMITS)
    assert out.shape == (m, n // 2) and out.dtype == dtype
    want = reference.silu_and_mul(reference.int4_linear(x.float(), qweight, scales, zeros, 64, bias))
    assert rel_err(out, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_int4_dequantize_is_exact(device: torch.device) -> None:
    qweight, scales, zeros = random_int4(33, 96, 32, device)
    expected = reference.dequantize_int4(qweight, scales, zeros, 32, torch.float32)
    assert torch.equal(dequantize_int4(qweight, scales, zeros, 32, torch.float32), expected)


def test_leading_dims_and_bad_shapes(device: torch.device) -> None:
    qweight = torch.randint(-127, 128, (24, 40), dtype=torch.int8, device=device)
    scales = torch.rand(24, device=device)
    x = torch.randn(2, 1, 40, device=device)
    out = int8_linear(x, qweight, scales, None, **SMALL_LIMITS)
    assert out.shape == (2, 1, 24)
    with pytest.raises(ValueError, match="int8_linear"):
        int8_linear(torch.randn(1, 41, device=device), qweight, scales, None)
    with pytest.raises(ValueError, match="int4_linear"):
        int4_linear(torch.randn(1, 64, device=device), *random_int4(8, 64, 32, device), 24, None)


def test_cpu_tensors_use_the_reference() -> None:
    qweight, scales, zeros = random_int4(8, 64, 32, torch.device("cpu"))
    x = torch.randn(3, 64)
    assert torch.equal(kernels.int4_linear(x, qweight, scales, zeros, 32, None),
                       reference.int4_linear(x, qweight, scales, zeros, 32, None))


LLAMA_8B_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # (N, K): o, qkv, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), LLAMA_8B_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 40, 700])
def test_quant_linears_gpu_bf16(n: int, k: int, m: int) -> None:
    """The engine's entry points (autotuned GEMV, GEMM, dequantize + cuBLAS) at Llama-3-8B shapes."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    s8 = torch.rand(n, device="cuda") * 0.002
    ref8 = reference.int8_linear(x.float(), q8, s8, None)
    assert rel_err(kernels.int8_linear(x, q8, s8, None), ref8) < tolerance(torch.bfloat16)
    q4, s4, z4 = random_int4(n, k, 128, torch.device("cuda"))
    ref4 = reference.int4_linear(x.float(), q4, s4, z4, 128, None)
    assert rel_err(kernels.int4_linear(x, q4, s4, z4, 128, None), ref4) < tolerance(torch.bfloat16)
    q_fp8 = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref_fp8 = reference.int8_linear(x.float(), q_fp8, s8, None)  # the same kernels read fp8 weights
    assert rel_err(kernels.int8_linear(x, q_fp8, s8, None), ref_fp8) < tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_quant_gemv_captures_in_a_cuda_graph() -> None:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    q4, s4, z4 = random_int4(4096, 4096, 128, torch.device("cuda"))
    q8 = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8, device="cuda")
    s8 = torch.rand(4096, device="cuda") * 0.002
    kernels.int4_linear(x, q4, s4, z4, 128, None)  # autotune outside the capture
    kernels.int8_linear(x, q8, s8, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out4 = kernels.int4_linear(x, q4, s4, z4, 128, None)
        out8 = kernels.int8_linear(x, q8, s8, None)
    x.normal_()
    graph.replay()
    assert rel_err(out4, reference.int4_linear(x.float(), q4, s4, z4, 128, None)) < tolerance(torch.bfloat16)
    assert rel_err(out8, reference.int8_linear(x.float(), q8, s8, None)) < tolerance(torch.bfloat16)
