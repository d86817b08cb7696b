"""The decode GEMV (kernels/gemv.py) against F.linear and the dequantize-then-matmul reference, on random odd
sizes and every weight dtype the engine gives it, with and without bias and scales."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.gemv import gemv  # noqa: E402
from kernels.gemv_configs import gemv_config  # noqa: E402
from kernels.quant_linear_config import GemvConfig  # noqa: E402

SMALL = [GemvConfig(block_n=4, block_k=64, num_warps=2), GemvConfig(block_n=1, block_k=32, num_warps=1, num_stages=3)]


def random_weight(n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, per-channel scales or None) of an [N, K] weight stored in dtype."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), dtype=dtype, device=device), torch.rand(n, device=device) * 0.01
    if dtype == torch.float8_e4m3fn:
        w = (torch.randn(n, k, device=device) * 50).clamp(-448, 448).to(dtype)
        return w, torch.rand(n, device=device) * 0.01
    return torch.randn(n, k, device=device).to(dtype), None


def expected(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
             ) -> torch.Tensor:
    full = w.float() if scales is None else reference.dequantize_int8(w, scales, torch.float32)
    return F.linear(x.float(), full, None if bias is None else bias.float())


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 200), (3, 64, 128), (2, 24, 96)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gemv_matches_reference(device: torch.device, weight_dtype: torch.dtype, m: int, n: int, k: int,
                                config: GemvConfig) -> None:
    w, scales = random_weight(n, k, weight_dtype, device)
    x = torch.randn(m, k, device=device)
    with poisoned_outputs():
        out = gemv(x, w, scales, config=config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert rel_err(out, expected(x, w, scales, None)) < 1e-5


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.int8])
def test_gemv_bias_and_leading_dims(device: torch.device, weight_dtype: torch.dtype) -> None:
    w, scales = random_weight(22, 160, weight_dtype, device)
    bias = torch.randn(22, device=device)
    x = torch.randn(2, 1, 160, device=device)
    out = gemv(x, w, scales, bias, config=SMALL[0])
    assert out.shape == (2, 1, 22)
    assert rel_err(out, expected(x, w, scales, bias)) < 1e-5


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 2 * 37, 200), (3, 2 * 24, 96)])
@pytest.mark.parametrize("config", SMALL, ids=["bn4", "bn1"])
def test_gated_gemv_equals_gemv_then_silu(device: torch.device, weight_dtype: torch.dtype, m: int, n: int, k: int,
                                          config: GemvConfig) -> None:
    """gated=True: silu(gate) * up of a fused [gate; up] weight, bit for bit what the plain GEMV followed by the SiLU
    kernel gives, and close to the float32 reference."""
    from kernels.activation import silu_and_mul

    w, scales = random_weight(n, k, weight_dtype, device)
    bias = torch.randn(n, device=device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32)
    with poisoned_outputs():
        out = gemv(x, w, scales, bias, config=config, gated=True)
    assert out.shape == (m, n // 2)
    assert torch.equal(out, silu_and_mul(gemv(x, w, scales, bias, config=config)))
    assert rel_err(out, reference.silu_and_mul(expected(x, w, scales, bias))) < tolerance(x.dtype)


def test_gemv_rejects_bad_shapes(device: torch.device) -> None:
    w = torch.randn(6, 32, device=device)
    with pytest.raises(ValueError, match="gemv: x"):
        gemv(torch.randn(1, 31, device=device), w)
    with pytest.raises(ValueError, match="scales of shape"):
        gemv(torch.randn(1, 32, device=device), w, torch.ones(5, device=device))
    assert gemv(torch.randn(0, 32, device=device), w).shape == (0, 6)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv(torch.randn(1, 32, device=device), w[:5], gated=True)


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 7168)]  # qkv, o, gate_up, down, down / 2


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_gpu_llama_shapes(n: int, k: int, weight_dtype: torch.dtype, m: int) -> None:
    """The shipped configurations at Llama-3-8B's shapes, bf16 activations."""
    w, scales = random_weight(n, k, weight_dtype, torch.device("cuda"))
    if weight_dtype == torch.bfloat16:
        w = w * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = gemv(x, w, scales, config=gemv_config(n, k, m, weight_dtype))
    assert rel_err(out, expected(x, w, scales, None)) < tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_linear_op_takes_the_gemv_for_one_row() -> None:
    """kernels.linear at the LM head's shape: one row through the GEMV, in a CUDA graph, and more rows through
    cuBLAS, both against float32."""
    import kernels

    w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(128256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    kernels.linear(x, w, bias)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear(x, w, bias)
    x.normal_()
    graph.replay()
    assert rel_err(out, expected(x, w, None, bias)) < tolerance(torch.bfloat16)
    rows = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    assert rel_err(kernels.linear(rows, w, bias), expected(rows, w, None, bias)) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [28672, 14336])  # Llama-3-8B's gate_up, whole and its TP = 2 shard
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_gate_up_silu_ops_in_a_graph(n: int, weight_dtype: torch.dtype) -> None:
    """kernels.linear_silu_and_mul / int8_linear_silu_and_mul at one row, captured in a CUDA graph with the shipped
    configuration, against the projection followed by the SiLU kernel (a gated program may read twice the rows of the
    plain one, which can change the order of its sums) and against float32; four rows equal the unfused path."""
    import kernels

    w, scales = random_weight(n, 4096, weight_dtype, torch.device("cuda"))
    if weight_dtype == torch.bfloat16:
        w = w * 0.02

    def fused(rows: torch.Tensor) -> torch.Tensor:
        if scales is None:
            return kernels.linear_silu_and_mul(rows, w)
        return kernels.int8_linear_silu_and_mul(rows, w, scales, None)

    def unfused(rows: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(kernels.linear(rows, w) if scales is None else
                                    kernels.int8_linear(rows, w, scales, None))

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    fused(x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x)
    x.normal_()
    graph.replay()
    assert out.shape == (1, n // 2) and rel_err(out, unfused(x)) < 1e-2
    assert rel_err(out, reference.silu_and_mul(expected(x, w, scales, None))) < tolerance(torch.bfloat16)
    rows = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fused(rows), unfused(rows))
