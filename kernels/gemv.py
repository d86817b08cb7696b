"""Decode GEMV: y = x W^T (+ b) for a few rows of x, W [N, K] in bf16 / fp16 / fp32, or int8 / float8_e4m3fn with
one float32 scale per output channel (applied once per output, after the sum over K).

At batch 1 a linear layer reads its weight once and does two FLOPs per weight element, so it is bound by
memory bandwidth; cuBLAS picks split-K GEMM kernels for these shapes that leave the smaller projections well
below it. Each program here owns BLOCK_N output channels and streams their rows over K."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_linear_config import GemvConfig


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One grid axis (the second is capped at 65535 programs); rows of x vary fastest, so the programs that read
    # one weight tile run together and share it through L2.
    m = tl.program_id(0) % M
    rows = (tl.program_id(0) // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        if EVEN:
            x = tl.load(x_row + k)
            w = tl.load(w_rows + k[None, :])
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALES:
        out *= tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] * scales[:, None])^T + bias -> [..., N] in x.dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv: x [..., {k}] and weight [{n}, {k}] with unit stride along K expected")
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"gemv: {name} of shape {tuple(t.shape)}, expected ({n},)")
    cfg = config or GemvConfig()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        placeholder = weight  # the kernel reads neither pointer when its flag is off
        gemv_kernel[(m * triton.cdiv(n, cfg.block_n),)](
            rows, weight, scales if scales is not None else placeholder, bias if bias is not None else placeholder,
            out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
            HAS_SCALES=scales is not None, HAS_BIAS=bias is not None,
            EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.view(*x.shape[:-1], n)
