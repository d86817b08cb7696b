"""Neox-style (rotate-half) rotary embedding of q and k; returns new tensors like the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_for_earlier_kernels


@triton.jit
def rotated_heads(
    src_ptr,
    token,
    cos,
    sin,
    stride_st,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """The rotated first and second halves [HEADS_PAD, HALF_PAD] of one token's heads (float32), and their mask."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    cos,
    sin,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    lo, hi, mask = rotated_heads(src_ptr, token, cos, sin, stride_st, stride_sh, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh + dims[None, :]
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, lo.to(out_ty), mask=mask)
    tl.store(dst + HALF, hi.to(out_ty), mask=mask)


@triton.jit
def cos_sin_of(positions_ptr, token, cos_sin_ptr, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """cos and sin [1, HALF_PAD] (float32) of one token's position."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dmask = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = cos_sin_of(positions_ptr, token, cos_sin_ptr, stride_cs, HALF, HALF_PAD)
    rotate_heads(
        q_ptr, q_out_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
        NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD,
    )
    rotate_heads(
        k_ptr, k_out_ptr, token, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
        NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD,
    )


def check_rotary_inputs(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    num_tokens, _, head_dim = q.shape
    if head_dim % 2 or k.shape[0] != num_tokens or k.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError("expected q [T, H, D], k [T, G, D] and cos_sin_cache [max_position, D] with D even")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, G, D], positions [T]; cos_sin_cache [max_position, D] holds cos then sin of the
    D/2 frequencies. Returns the rotated (q, k) as new tensors."""
    check_rotary_inputs(q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads,
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
        **launch_options(q),
    )
    return q_out, k_out
