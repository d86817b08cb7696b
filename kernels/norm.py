"""RMSNorm and the fused residual add + RMSNorm, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, let_later_kernels_launch, wait_for_earlier_kernels


@triton.jit
def store_rms_normed(x, weight, out_row_ptr, cols, mask, eps, N: tl.constexpr):
    """Writes one row's rms_norm(x) * weight; x is the row as the reference rounds it (its own dtype), weight the
    norm's weights as loaded."""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    tl.store(out_row_ptr + cols, (xf * inv_rms * weight.to(tl.float32)).to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The reference rounds the sum to the input dtype before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * stride_s + cols, x, mask=mask)
    let_later_kernels_launch(EARLY)
    store_rms_normed(x, weight, out_ptr + row * stride_o, cols, mask, eps, N)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must have shape ({n},), got {tuple(weight.shape)}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = _rows(residual)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s2 = summed.view(-1, n)
    else:
        r2, summed, s2 = x2, None, out2
    if x2.shape[0] == 0:
        return out, summed
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight.contiguous(),
        out2,
        s2,
        eps,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        s2.stride(0),
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
        **launch_options(x2, early=True),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors, like the reference."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
