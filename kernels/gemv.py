"""Decode GEMV: y = x W^T (+ b) for a few rows of x, W [N, K] in bf16 / fp16 / fp32, or int8 / float8_e4m3fn with
one float32 scale per output channel (applied once per output, after the sum over K).

At batch 1 a linear layer reads its weight once and does two FLOPs per weight element, so it is bound by
memory bandwidth; cuBLAS picks split-K GEMM kernels for these shapes that leave the smaller projections well
below it. Each program here owns BLOCK_N output channels and streams their rows over K."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv_rows import Fusions, gated_block_n, inverse_rms, program_rows, store_outputs
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.quant_linear_config import GemvConfig


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    norm_weight_ptr, residual_ptr, eps,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # every program's rows in range and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr = False,  # N output channels of silu(gate) * up from 2N weight rows (kernels/gemv_rows.py)
    NORM: tl.constexpr = False,  # x is normed on the way in (kernels/gemv_rows.py)
    RESIDUAL: tl.constexpr = False,  # the residual rows are added to the outputs
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    # One grid axis (the second is capped at 65535 programs); rows of x vary fastest, so the programs that read
    # one weight tile run together and share it through L2.
    m = tl.program_id(0) % M
    pid_n = tl.program_id(0) // M
    rows, row_ok = program_rows(pid_n, N, BLOCK_N, GATED)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        if EVEN:
            x = tl.load(x_row + k).to(tl.float32)
            w = tl.load(w_rows + k[None, :])
        else:
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        if NORM:
            squares += x * x
            x *= tl.load(norm_weight_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if NORM:
        out *= inverse_rms(tl.sum(squares, axis=0), K, eps)
    if HAS_SCALES:
        out *= tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_outputs(out_ptr + m.to(tl.int64) * stride_om, out, pid_n, N, row_ok, BLOCK_N, GATED,
                  residual_ptr + m.to(tl.int64) * N, RESIDUAL)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    gated: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] * scales[:, None])^T + bias -> [..., N] in x.dtype; gated: silu of the first N / 2
    outputs times the last N / 2 -> [..., N / 2]. norm = (weight [K], eps): the product is taken with
    rms_norm(x, weight, eps) instead of x; residual [..., N]: added to the outputs."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv: x [..., {k}] and weight [{n}, {k}] with unit stride along K expected")
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"gemv: {name} of shape {tuple(t.shape)}, expected ({n},)")
    if gated and n % 2:
        raise ValueError(f"gemv: a gated weight needs an even number of rows, got {n}")
    cfg = config or GemvConfig()
    block_n = gated_block_n(cfg.block_n) if gated else cfg.block_n
    channels, per_program = (n // 2, block_n // 2) if gated else (n, block_n)
    m = rows.shape[0]
    fusions = Fusions.checked("gemv", m, k, channels, x.dtype, gated, norm, residual)
    out = torch.empty((m, channels), dtype=x.dtype, device=x.device)
    if m:
        placeholder = weight  # the kernel reads none of these pointers when its flag is off
        gemv_kernel[(m * triton.cdiv(channels, per_program),)](
            rows, weight, scales if scales is not None else placeholder, bias if bias is not None else placeholder,
            out, m, channels, k, rows.stride(0), weight.stride(0), out.stride(0), **fusions.launch_args(placeholder),
            HAS_SCALES=scales is not None, HAS_BIAS=bias is not None,
            EVEN=channels % per_program == 0 and k % cfg.block_k == 0,
            BLOCK_N=block_n, BLOCK_K=cfg.block_k, GATED=gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_options(x),
        )
    return out.view(*x.shape[:-1], channels)
