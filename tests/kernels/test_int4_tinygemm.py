"""int4 through torch's tinygemm kernel against our dequantize-then-matmul reference."""

import pytest
import torch

from kernels import formats, reference
from kernels.int4_tinygemm import MAX_ROWS, pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from tests.kernels.helpers import rel_err
from tests.kernels.test_quant_linear import random_int4


@pytest.mark.parametrize("group_size", [64, 128])
def test_scales_and_zeros_carry_our_zero_points(group_size: int) -> None:
    """tinygemm's CPU twin reads the same scales/zeros layout, so the (8 - z) * scale conversion is checked here."""
    n, k = 48, 256
    qweight, scales, zeros = random_int4(n, k, group_size, torch.device("cpu"))
    x = torch.randn(3, k).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(formats.unpack_int4(qweight), 2)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, tinygemm_scales_and_zeros(scales, zeros))
    want = x.float() @ reference.dequantize_int4(qweight, scales, zeros, group_size, torch.float32).T
    assert rel_err(got.float(), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tinygemm_linear_gpu(m: int, with_bias: bool) -> None:
    cuda = torch.device("cuda")
    n, k, group_size = 264, 1024, 128
    qweight, scales, zeros = random_int4(n, k, group_size, cuda)
    bias = torch.randn(n, device=cuda, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
    got = tinygemm_linear(x, *pack_for_tinygemm(qweight, scales, zeros), group_size, bias)
    want = x.float() @ reference.dequantize_int4(qweight, scales, zeros, group_size, torch.float32).T
    if bias is not None:
        want = want + bias.float()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel_err(got.float(), want) < 1e-2


@pytest.mark.gpu
def test_int4_linear_uses_tinygemm_for_decode_rows_only() -> None:
    from engine.quantization.int4 import Int4Linear

    cuda = torch.device("cuda")
    weight = torch.randn(512, 2048, device=cuda, dtype=torch.bfloat16) * 0.02
    linear = Int4Linear.from_weight(weight, None)
    assert linear.tinygemm is not None
    dense = linear.dequantize(torch.float32)
    for m in (1, MAX_ROWS, MAX_ROWS + 1, 100):
        x = torch.randn(m, 2048, device=cuda, dtype=torch.bfloat16)
        assert rel_err(linear(x).float(), x.float() @ dense.T) < 1e-2
