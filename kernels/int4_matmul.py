"""Weight-only int4 linear, groups of G along K with zero points (the AWQ/GPTQ scheme):
W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G], q packed eight to an int32 along K
(qweight [N, K/8], nibble i of word j is column 8j + i; see kernels/formats.py).

One bf16 row on CUDA runs kernels/gemv_int4_a8.py (activations rounded to int8 in runs of 16, DP4A), or
kernels/gemv_int4.py (half precision) where that kernel cannot take the tensors or int8_activations=False. Up to
GEMV_MAX_M rows of any float dtype run the float32 GEMV here, which turns nibbles into floats without an
int-to-float conversion: the nibble is OR-ed into the top mantissa bits of 16.0, giving the float 16 + q exactly,
and per word scale and zero point apply once: sum_i (q_i - z) * s * x_i = s * (sum_i (16 + q_i) x_i - (16 + z)
sum_i x_i). Wide layers (gate_up) at up to 64 rows run a tensor-core GEMM; other shapes and more rows dequantize the
weight in one pass and call cuBLAS, which on an H200 beat both that GEMM and tinygemm from 17 rows on the other
layers (BENCHMARKS.md)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import triton
import triton.language as tl

from kernels import gemv_int4_a8
from kernels.activation import silu_and_mul
from kernels.gemv_configs import int4_gemv_config
from kernels.gemv_int4 import gemv_int4, gemv_int4_takes
from kernels.norm import rms_norm
from kernels.quant_linear_config import GEMV_MAX_M, GemmConfig, GemvConfig
from kernels.quant_linear_launch import QuantLinearKernels, autotuned_gemv, launch_quant_linear
from kernels.reference import norm_project_add


@triton.jit
def _nibble_plus_16(words, i: tl.constexpr):
    """Nibble i of each int32 word as the float32 16 + nibble (the nibble lands in mantissa bits 19..22)."""
    if 19 - 4 * i >= 0:
        shifted = words << (19 - 4 * i)
    else:
        shifted = words >> (4 * i - 19)
    return ((shifted & 0x780000) | 0x41800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)[:, None]
    num_words = K // 8
    words = tl.arange(0, BLOCK_K // 8)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
    for w0 in range(0, num_words, BLOCK_K // 8):
        w_idx = w0 + words
        w_ok = w_idx < num_words
        tile_ok = row_ok[:, None] & w_ok[None, :]
        q = tl.load(qw_ptr + rows64 * stride_qn + w_idx[None, :], mask=tile_ok, other=0)
        group = (w_idx * 8) // GROUP_SIZE
        s = tl.load(scales_ptr + rows64 * stride_sn + group[None, :], mask=tile_ok, other=0.0)
        z = tl.load(zeros_ptr + rows64 * stride_zn + group[None, :], mask=tile_ok, other=0).to(tl.float32)
        dot = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        x_sum = tl.zeros([BLOCK_K // 8], tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + w_idx * 8 + i, mask=w_ok, other=0.0).to(tl.float32)
            dot += _nibble_plus_16(q, i) * xi[None, :]
            x_sum += xi
        acc += s * (dot - (z + 16.0) * x_sum[None, :])
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


_int4_gemv_autotuned = autotuned_gemv(
    _int4_gemv_kernel, [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 256, 4), (4, 2048, 8)]
)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE (and so K): each K tile lies in one group
    DOT_PRECISION: tl.constexpr,
):
    # The weight tile is read as [BLOCK_N, BLOCK_K / 8] words along K (contiguous rows), its nibbles spread by shifts
    # and turned into q - z exactly through the float 2**23 + q; the tensor cores multiply those small integers and
    # the group's scale multiplies the tile's [BLOCK_M, BLOCK_N] partial sums instead of every weight.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = qw_ptr + rn64[:, None] * stride_qn + tl.arange(0, BLOCK_K // 8)[None, :]
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + rn64 * stride_sn + group, mask=n_ok, other=0.0)
        z = tl.load(zeros_ptr + rn64 * stride_zn + group, mask=n_ok, other=0).to(tl.float32)
        nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        q_minus_z = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + z[:, None, None])
        b = tl.trans(tl.reshape(q_minus_z, [BLOCK_N, BLOCK_K]).to(a.dtype))
        acc += tl.dot(a, b, input_precision=DOT_PRECISION) * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantized_tile(qw_ptr, scales_ptr, zeros_ptr, rk, rn, stride_qn, stride_sn, stride_zn, K, N,
                      GROUP_SIZE: tl.constexpr):
    """W^T[rk, rn] as float32: [BLOCK_K, BLOCK_N], zero outside the matrix."""
    ok = (rk < K)[:, None] & (rn < N)[None, :]
    rn64 = rn.to(tl.int64)[None, :]
    words = tl.load(qw_ptr + rn64 * stride_qn + (rk // 8)[:, None], mask=ok, other=0)
    q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
    group = (rk // GROUP_SIZE)[:, None]
    s = tl.load(scales_ptr + rn64 * stride_sn + group, mask=ok, other=0.0)
    z = tl.load(zeros_ptr + rn64 * stride_zn + group, mask=ok, other=0)
    return (q - z.to(tl.int32)).to(tl.float32) * s


@triton.jit
def _int4_dequantize_kernel(
    qw_ptr, scales_ptr, zeros_ptr, out_ptr,
    N, K,
    stride_qn, stride_sn, stride_zn, stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w_t = _dequantized_tile(qw_ptr, scales_ptr, zeros_ptr, rk, rn, stride_qn, stride_sn, stride_zn, K, N, GROUP_SIZE)
    ptrs = out_ptr + rn.to(tl.int64)[None, :] * stride_on + rk[:, None]
    tl.store(ptrs, w_t.to(out_ptr.dtype.element_ty), mask=(rk < K)[:, None] & (rn < N)[None, :])


_INT4_KERNELS = QuantLinearKernels(gemv=_int4_gemv_kernel, gemv_autotuned=_int4_gemv_autotuned, gemm=_int4_gemm_kernel)
# The GEMM beat tinygemm and dequantize + cuBLAS only on the widest layer timed (Llama-3-8B's gate_up, 28672 x 4096)
# at 16-64 rows on an H200 (BENCHMARKS.md); the bound also takes in its TP = 2 half (14336 wide, not timed).
# Elsewhere more rows than the GEMV takes dequantize and call cuBLAS.
GEMM_MIN_N = 14336
GEMM_MAX_ROWS = 64


def int4_gemm_config(m: int) -> GemmConfig:
    """The tile of the best of six at Llama-3-8B's gate_up: 16 rows up to 16, 64 above."""
    return GemmConfig(16, 128, 128, 4, 4) if m <= 16 else GemmConfig(64, 128, 128, 4, 3)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
           ) -> tuple[int, int]:
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if (x.shape[-1] != k or group_size % 8 or k % group_size or scales.shape != (n, k // group_size)
            or zeros.shape != scales.shape or qweight.stride(-1) != 1 or scales.stride(-1) != 1
            or zeros.stride(-1) != 1):
        raise ValueError(
            f"int4_linear: x [..., {k}], qweight [{n}, {k // 8}], scales and zeros [{n}, K/G] (unit stride "
            f"along K) and a group size dividing K that is a multiple of 8 expected; got group_size={group_size}"
        )
    return n, k


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in dtype (one pass over the packed weight)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 8
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 64, 64
    _int4_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros, out, n, k, qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    *,
    gated: bool = False,
    gemv: GemvConfig | None = None,
    gemm: GemmConfig | None = None,
    max_gemv_m: int = GEMV_MAX_M,
    max_gemm_m: int | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    int8_activations: bool = True,
) -> torch.Tensor:
    """x [..., K] @ dequantized(qweight, scales, zeros)^T + bias -> [..., N] in x.dtype: one bf16 row through
    kernels/gemv_int4_a8.py where int8_activations is set, it takes the tensors and no gemv config is given, else
    through kernels/gemv_int4.py (config: gemv, else kernels/gemv_configs.py's rule), up to max_gemv_m rows through the
    float32 GEMV (autotuned on CUDA per (N, K) without a config), up to max_gemm_m (default: GEMM_MAX_ROWS on
    layers of GEMM_MIN_N outputs or more, else none) through the tensor-core GEMM, more through dequantize + cuBLAS.
    gated: silu of the first N / 2 outputs times the last N / 2 -> [..., N / 2] (a fused gate_up projection).
    norm = (weight [K], eps): of rms_norm(x, *norm); residual [..., N]: added to the outputs (both fused in the
    one-row GEMV, separate kernels elsewhere)."""
    n, k = _check(x, qweight, scales, zeros, group_size)
    a8_norm = None if gated else norm  # at gate_up's width the norm kernel first is faster (BENCHMARKS.md)
    if (int8_activations and x.numel() == k and max_gemv_m and gemv is None
            and gemv_int4_a8.takes(x, qweight, scales, zeros, group_size, bias, gated, a8_norm, residual)):
        if norm is not a8_norm:
            x = rms_norm(x, *norm)
        return gemv_int4_a8.launch_taken(x, qweight, scales, zeros, group_size, bias, gated=gated, norm=a8_norm,
                                         residual=residual)
    if (x.numel() == k and max_gemv_m and x.dtype == torch.bfloat16
            and gemv_int4_takes(qweight, scales, zeros, group_size)
            and (norm is None or norm[0].dtype == torch.bfloat16)):
        config = gemv or int4_gemv_config(n, k, gated, normed=norm is not None)
        return gemv_int4(x, qweight, scales, zeros, group_size, bias, config=config, gated=gated, norm=norm,
                         residual=residual)
    if gated and residual is not None:
        raise ValueError("int4_linear: a gated projection takes no residual")
    if norm is not None or residual is not None:
        unfused = partial(int4_linear, qweight=qweight, scales=scales, zeros=zeros, group_size=group_size, bias=bias,
                          gated=gated, gemv=gemv, gemm=gemm, max_gemv_m=max_gemv_m, max_gemm_m=max_gemm_m,
                          int8_activations=int8_activations)
        return norm_project_add(unfused, x, norm, residual, rms_norm)
    if max_gemm_m is None:
        max_gemm_m = GEMM_MAX_ROWS if n >= GEMM_MIN_N else max_gemv_m
    if group_size < 16 or group_size & (group_size - 1):
        max_gemm_m = max_gemv_m  # the GEMM's K tiles must lie within one group and hold 16 columns
    cfg = gemm or int4_gemm_config(x.numel() // k if k else 0)
    out = launch_quant_linear(
        _INT4_KERNELS, x, (qweight, scales, zeros), (qweight.stride(0), scales.stride(0), zeros.stride(0)), n, bias,
        lambda dtype: dequantize_int4(qweight, scales, zeros, group_size, dtype), {"GROUP_SIZE": group_size},
        gemv=gemv, gemm=replace(cfg, block_k=min(cfg.block_k, group_size)), max_gemv_m=max_gemv_m,
        max_gemm_m=max_gemm_m,
    )
    return silu_and_mul(out) if gated else out
