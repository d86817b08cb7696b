"""Launch parameters shared by the weight-only quantized linear kernels, and the batch-size thresholds
that pick a kernel: M rows of activations (tokens) times a quantized [N, K] weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# M <= GEMV_MAX_M: one program per (row, BLOCK_N outputs), plain FMAs (decode: int8 / fp8 through kernels/gemv.py,
# one bf16 row of int8 through kernels/gemv_int.py; the weight is read once from DRAM, the other rows' programs
# run next to it and hit L2).
GEMV_MAX_M = 8
# GEMV_MAX_M < M <= GEMM_MAX_M: tensor-core GEMM that dequantizes weight tiles in registers
# (int4: only on wide layers, see kernels/int4_matmul.py).
GEMM_MAX_M = 512
# Above that (long prefills) the layer is compute bound: dequantize the whole weight once, then cuBLAS.


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def gemm_config_for(m: int) -> GemmConfig:
    if m <= 16:
        return GemmConfig(16, 64, 128, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, 64, 4, 4)
    return GemmConfig(128, 128, 64, 8, 3)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K] with unit stride along K."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
