"""Weight-only int8 linear: y = x (q * scales[:, None])^T + b, with q [N, K] int8 and one float32 scale
per output channel. The weight is converted in registers; the per-channel scale is applied once per
output, after the sum over K. Batch-1 decode is bound by reading the weight, which is half of bf16's.
The same kernels read float8_e4m3fn weights with per-channel scales (fp8 decode, engine/quantization/fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_linear_config import GEMM_MAX_M, GEMV_MAX_M, GemmConfig, GemvConfig
from kernels.quant_linear_launch import QuantLinearKernels, autotuned_gemv, launch_quant_linear
from kernels.reference import dequantize_int8


@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)  # rows vary fastest: the programs of one weight tile run together
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1) * tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


_int8_gemv_autotuned = autotuned_gemv(
    _int8_gemv_kernel, [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (16, 256, 4), (4, 2048, 8)]
)


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # the [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        a = tl.load(x_ptrs, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scales_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


_INT8_KERNELS = QuantLinearKernels(gemv=_int8_gemv_kernel, gemv_autotuned=_int8_gemv_autotuned, gemm=_int8_gemm_kernel)


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
    max_gemv_m: int = GEMV_MAX_M,
    max_gemm_m: int = GEMM_MAX_M,
) -> torch.Tensor:
    """x [..., K] @ dequantized(qweight [N, K] int8 or float8_e4m3fn, scales [N] float32)^T + bias -> [..., N].
    Without configs, the GEMV is autotuned on CUDA per (N, K)."""
    n, k = qweight.shape
    if x.shape[-1] != k or scales.shape != (n,) or qweight.stride(-1) != 1:
        raise ValueError(f"int8_linear: x [..., {k}], qweight [{n}, {k}] contiguous and scales [{n}] expected")
    return launch_quant_linear(
        _INT8_KERNELS, x, (qweight, scales), (qweight.stride(0),), n, bias,
        lambda dtype: dequantize_int8(qweight, scales, dtype), {},
        gemv=gemv, gemm=gemm, max_gemv_m=max_gemv_m, max_gemm_m=max_gemm_m,
    )
