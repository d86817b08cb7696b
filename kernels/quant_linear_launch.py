"""Picks and launches one of a weight-only quantized linear's kernels for M rows of activations: the GEMV
(decode), the GEMM that dequantizes weight tiles in registers, or a dequantized weight and cuBLAS
(long prefills); see quant_linear_config.py for the thresholds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton

from kernels.quant_linear_config import (
    GEMM_MAX_M,
    GEMV_MAX_M,
    GemmConfig,
    GemvConfig,
    as_rows,
    dot_precision,
    gemm_config_for,
)


def autotuned_gemv(kernel: Any, block_n_block_k_warps: list[tuple[int, int, int]]) -> Any:
    """The GEMV kernel under triton.autotune over the given (BLOCK_N, BLOCK_K, num_warps), keyed on (N, K)."""
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in block_n_block_k_warps
        ],
        key=["N", "K"],
    )(kernel)


@dataclass(frozen=True)
class QuantLinearKernels:
    """The Triton kernels of one quantization scheme. Each takes (x, *weight, bias, out, M, N, K, stride of x,
    *weight strides, stride of out) and the constexprs HAS_BIAS and BLOCK_*; the GEMM also DOT_PRECISION."""

    gemv: Any  # triton.JITFunction with BLOCK_N, BLOCK_K; None for int8 (its GEMVs are routed before this)
    gemv_autotuned: Any  # the GEMV under triton.autotune over BLOCK_N, BLOCK_K, keyed on (N, K)
    gemm: Any  # triton.JITFunction with BLOCK_M, BLOCK_N, BLOCK_K


def launch_quant_linear(
    kernels: QuantLinearKernels,
    x: torch.Tensor,
    weight: Sequence[torch.Tensor],
    weight_strides: Sequence[int],
    n: int,
    bias: torch.Tensor | None,
    dequantized_weight: Callable[[torch.dtype], torch.Tensor],
    constants: dict[str, int],
    *,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
    max_gemv_m: int = GEMV_MAX_M,
    max_gemm_m: int = GEMM_MAX_M,
) -> torch.Tensor:
    """x [..., K] times the quantized [N, K] weight, plus bias -> [..., N] in x.dtype. weight: the tensors
    the kernels read, qweight then scales first; constants: the scheme's own constexprs (e.g. GROUP_SIZE).
    Without configs, the GEMV is autotuned on CUDA per (N, K)."""
    rows = as_rows(x)
    m = rows.shape[0]
    k = x.shape[-1]
    if m > max_gemm_m:
        return F.linear(x, dequantized_weight(x.dtype), bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    bias_arg = bias if bias is not None else weight[1]  # any tensor: the kernels do not read it without a bias
    args = (rows, *weight, bias_arg, out, m, n, k, rows.stride(0), *weight_strides, out.stride(0))
    has_bias = bias is not None
    if m <= max_gemv_m:
        if gemv is None and x.is_cuda:
            kernels.gemv_autotuned[lambda meta: (m, triton.cdiv(n, meta["BLOCK_N"]))](
                *args, **constants, HAS_BIAS=has_bias
            )
        else:
            cfg = gemv or GemvConfig()
            kernels.gemv[(m, triton.cdiv(n, cfg.block_n))](
                *args, **constants, HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
    else:
        cfg = gemm or gemm_config_for(m)
        kernels.gemm[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
            *args, **constants, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.view(*x.shape[:-1], n)
