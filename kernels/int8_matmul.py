"""Weight-only int8 linear: y = x (q * scales[:, None])^T + b, with q [N, K] int8 and one float32 scale
per output channel. The weight is converted in registers; the per-channel scale is applied once per
output, after the sum over K. One bf16 row (batch-1 decode) runs kernels/gemv_int.py, a few rows kernels/gemv.py.
The same kernels read float8_e4m3fn weights with per-channel scales (fp8 decode, engine/quantization/fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.gemv import gemv as gemv_rows
from kernels.gemv_configs import gated_gemv_config, gemv_config, normed_gemv_config
from kernels.gemv_int import gemv_int8
from kernels.norm import rms_norm
from kernels.quant_linear_config import GEMM_MAX_M, GEMV_MAX_M, GemmConfig, GemvConfig
from kernels.quant_linear_launch import QuantLinearKernels, launch_quant_linear
from kernels.reference import dequantize_int8, norm_project_add


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


_INT8_KERNELS = QuantLinearKernels(gemv=None, gemv_autotuned=None, gemm=_int8_gemm_kernel)  # GEMVs: below


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gated: bool = False,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
    max_gemv_m: int = GEMV_MAX_M,
    max_gemm_m: int = GEMM_MAX_M,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequantized(qweight [N, K] int8 or float8_e4m3fn, scales [N] float32)^T + bias -> [..., N].
    gated: silu of the first N / 2 outputs times the last N / 2 -> [..., N / 2] (a fused gate_up projection), in the
    GEMVs' epilogue, after the GEMM through kernels/activation.py. Without a GEMV config, the one
    kernels/gemv_configs.py gives for the shape. norm = (weight [K], eps): of rms_norm(x, *norm); residual [..., N]:
    added to the outputs (both fused in the GEMVs, separate kernels around the GEMM)."""
    n, k = qweight.shape
    if x.shape[-1] != k or scales.shape != (n,) or qweight.stride(-1) != 1:
        raise ValueError(f"int8_linear: x [..., {k}], qweight [{n}, {k}] contiguous and scales [{n}] expected")
    m = x.numel() // k
    rule = gated_gemv_config if gated else gemv_config
    if m == 1 and norm is not None and gemv is None and max_gemv_m:
        gemv = normed_gemv_config(n, k, qweight.dtype, gated)
        if gemv is None:  # measured faster after a separate norm kernel than fused
            x, norm = rms_norm(x, *norm), None
    fusions = {"norm": norm, "residual": residual}
    if (m == 1 and max_gemv_m and x.dtype == torch.bfloat16 and qweight.dtype == torch.int8 and k % 4 == 0
            and (norm is None or norm[0].dtype == torch.bfloat16)):
        return gemv_int8(x, qweight, scales, bias, config=gemv or rule(n, k, m, qweight.dtype), gated=gated,
                         **fusions)
    if 0 < m <= max_gemv_m:
        return gemv_rows(x, qweight, scales, bias, config=gemv or rule(n, k, m, qweight.dtype), gated=gated,
                         **fusions)
    if gated and residual is not None:
        raise ValueError("int8_linear: a gated projection takes no residual")
    out = norm_project_add(
        lambda h: launch_quant_linear(
            _INT8_KERNELS, h, (qweight, scales), (qweight.stride(0),), n, bias,
            lambda dtype: dequantize_int8(qweight, scales, dtype), {},
            gemm=gemm, max_gemv_m=0, max_gemm_m=max_gemm_m,
        ), x, norm, residual, rms_norm)
    return silu_and_mul(out) if gated else out
