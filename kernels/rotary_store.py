"""Rotary embedding fused with the KV-cache store: one program per token writes its rotated q and puts its rotated
k (rounded to k's dtype, then quantized for an int8 / fp8 cache, exactly as the two separate kernels do) and its v
into their page slot. At batch-1 decode both kernels are one short program each; fused, a layer launches one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cache_ops import check_cache_inputs, quantize
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.rotary import check_rotary_inputs, cos_sin_of, rotate_heads, rotated_heads


@triton.jit
def _store_heads(dst, lo, hi, mask, scale, QUANT: tl.constexpr, HALF: tl.constexpr):
    if QUANT != 0:
        lo = quantize(lo, scale, QUANT)
        hi = quantize(hi, scale, QUANT)
    tl.store(dst, lo.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, hi.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kv_store_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, kv_scales_ptr,
    cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_cb, stride_cs, stride_ch, stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = cos_sin_of(positions_ptr, token, cos_sin_ptr, stride_cos, HALF, HALF_PAD)
    rotate_heads(q_ptr, q_out_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    slot_offset = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    page = slot_offset + heads[:, None] * stride_ch + dims[None, :]
    k_scale = tl.load(kv_scales_ptr + heads, mask=(heads < NUM_KV_HEADS) & (QUANT != 0), other=1.0)
    v_scale = tl.load(kv_scales_ptr + NUM_KV_HEADS + heads, mask=(heads < NUM_KV_HEADS) & (QUANT != 0), other=1.0)
    k_lo, k_hi, mask = rotated_heads(k_ptr, token, cos, sin, stride_kt, stride_kh, NUM_KV_HEADS, KV_HEADS_PAD,
                                     HALF, HALF_PAD)
    k_ty = k_ptr.dtype.element_ty
    _store_heads(k_cache_ptr + page, k_lo.to(k_ty), k_hi.to(k_ty), mask, k_scale, QUANT, HALF)
    v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    v_lo = tl.load(v_src, mask=mask, other=0.0)
    v_hi = tl.load(v_src + HALF, mask=mask, other=0.0)
    _store_heads(v_cache_ptr + page, v_lo, v_hi, mask, v_scale, QUANT, HALF)


def rotary_kv_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates q [T, H, D] and k [T, G, D] by positions [T] (as kernels/rotary.py), writes the rotated k and v [T, G, D]
    into the pages at slot_mapping [T] (as kernels/cache_ops.py; negative slots skipped) and returns the rotated q."""
    check_rotary_inputs(q, k, cos_sin_cache)
    scales, quant = check_cache_inputs(k, v, k_cache, v_cache, kv_scales)
    if v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must share one layout (equal strides)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kv_store_kernel[(num_tokens,)](
        positions, q, k, v, q_out, k_cache, v_cache, slot_mapping, k if scales is None else scales, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1],
        QUANT=quant,
        num_warps=4,
        **launch_options(q),
    )
    return q_out
