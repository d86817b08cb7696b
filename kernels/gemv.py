"""Decode GEMV: y = x W^T (+ b) for a few rows of x, W [N, K] in bf16 / fp16 / fp32, or int8 / float8_e4m3fn with
one float32 scale per output channel (applied once per output, after the sum over K).

At batch 1 a linear layer reads its weight once and does two FLOPs per weight element, so it is bound by
memory bandwidth; cuBLAS picks split-K GEMM kernels for these shapes that leave the small projections well
below it. Each program here owns BLOCK_N output channels and streams their rows over K; with SILU_MUL the
weight is a fused [gate; up] pair ([2N, K]) and the program writes silu(gate) * up for its N outputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_linear_config import GemvConfig


@triton.jit
def _dot_rows(x_row, w_rows, k, row_ok, k_ok, EVEN: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W times the matching slice of x, elementwise (summed by the caller)."""
    if EVEN:
        x = tl.load(x_row + k).to(tl.float32)
        w = tl.load(w_rows + k[None, :])
    else:
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return w.to(tl.float32) * x[None, :]


@triton.jit
def _dot_rows_int8_bits(x_row, w_rows, k, EXTEND: tl.constexpr):
    """As _dot_rows for int8 weights without int-to-float conversions: v + 128 in the low mantissa bits of
    2^23 is the float 2^23 + v + 128; one subtraction recovers v."""
    w = tl.load(w_rows + k[None, :])
    x = tl.load(x_row + k).to(tl.float32)
    if EXTEND:
        bits = w.to(tl.int32) + 0x4B000080
    else:
        bits = (w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
    return (bits.to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]


@triton.jit
def _channel_epilogue(acc, rows, row_ok, scales_ptr, bias_ptr, HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1)
    if HAS_SCALES:
        out *= tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INT8_MODE: tl.constexpr = 0,
):
    # One axis (the second is capped at 65535 programs); rows of x vary fastest, so the programs that read one
    # weight tile run together and share it through L2.
    m = tl.program_id(0) % M
    rows = (tl.program_id(0) // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if SILU_MUL:
        up_rows = w_rows + N.to(tl.int64) * stride_wn
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        if INT8_MODE == 0:
            acc += _dot_rows(x_row, w_rows, k, row_ok, k_ok, EVEN)
        else:
            acc += _dot_rows_int8_bits(x_row, w_rows, k, INT8_MODE == 1)
        if SILU_MUL:
            acc_up += _dot_rows(x_row, up_rows, k, row_ok, k_ok, EVEN)
    out = _channel_epilogue(acc, rows, row_ok, scales_ptr, bias_ptr, HAS_SCALES, HAS_BIAS)
    if SILU_MUL:
        up = _channel_epilogue(acc_up, rows + N, row_ok, scales_ptr, bias_ptr, HAS_SCALES, HAS_BIAS)
        out = out / (1.0 + tl.exp(-out)) * up
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: GemvConfig | None = None,
    int8_mode: int = 0,
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] * scales[:, None])^T + bias -> [..., N] in x.dtype; with silu_mul, weight is
    [2N, K] (gate rows, then up rows) and the result silu(x gate^T) * (x up^T) -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    total_n, k = weight.shape
    n = total_n // 2 if silu_mul else total_n
    if x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv: x [..., {k}] and weight [{total_n}, {k}] with unit stride along K expected")
    if silu_mul and total_n % 2:
        raise ValueError(f"gemv: weight has {total_n} rows; silu_mul needs [gate; up], an even number")
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and t.shape != (total_n,):
            raise ValueError(f"gemv: {name} of shape {tuple(t.shape)}, expected ({total_n},)")
    cfg = config or GemvConfig()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        even = n % cfg.block_n == 0 and k % cfg.block_k == 0
        placeholder = weight  # the kernel reads neither pointer when its flag is off
        gemv_kernel[(m * triton.cdiv(n, cfg.block_n),)](
            rows, weight, scales if scales is not None else placeholder, bias if bias is not None else placeholder,
            out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
            HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN=even,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            INT8_MODE=int8_mode,
        )
    return out.view(*x.shape[:-1], n)
