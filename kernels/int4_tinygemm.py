"""int4 decode through torch's own tinygemm kernel (aten._weight_int4pack_mm: CUDA, bf16 activations),
the kernel gpt-fast and torchao use for weight-only int4, instead of the Triton GEMV.

tinygemm stores the weight in its tensor-core tile order and dequantizes (q - 8) * scale + zero with
bf16 scales and zeros per (group, output channel). Ours is (q - z) * scale with an integer zero
point z, so zero = (8 - z) * scale carries it over exactly up to bf16 rounding of scale and zero."""

from __future__ import annotations

import torch

from kernels.formats import unpack_int4

INNER_K_TILES = 8
GROUP_SIZES = (32, 64, 128, 256)
# Rows up to which tinygemm beats dequantizing (decode batches); above, the Triton GEMM or cuBLAS take over.
MAX_ROWS = 16


def tinygemm_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return group_size in GROUP_SIZES and in_features % (INNER_K_TILES * 16) == 0 and out_features % 8 == 0


def tinygemm_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales [N, G] float, zero points [N, G] in 0..15 -> [G, N, 2] bf16 (scale, zero)."""
    scales = scales.float()
    pairs = torch.stack([scales, (8.0 - zeros.float()) * scales], dim=-1)
    return pairs.transpose(0, 1).contiguous().to(torch.bfloat16)


def pack_for_tinygemm(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [N, K/8] int32 nibbles (see kernels/formats.py) -> tinygemm's packed weight and scales/zeros."""
    q = unpack_int4(qweight)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]: even column in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    return packed, tinygemm_scales_and_zeros(scales, zeros)


def tinygemm_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten._weight_int4pack_mm(rows, packed, group_size, scales_and_zeros)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
