"""Writes the new tokens' keys and values into the paged KV cache, quantizing for an int8 / fp8 cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.kv_layout import check_kv_scales

_NO_QUANT, _INT8, _FP8 = 0, 1, 2


@triton.jit
def _round_to_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still as float32.
    Done with exact integer and float ops so that the cast after it never rounds (Triton's interpreter
    rounds fp8 casts wrongly)."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range (|y| >= 2^-6): keep the top 3 of the 23 mantissa bits, round half to even
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9
    t = y * 512.0
    whole = tl.floor(t)
    frac = t - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    subnormal = (whole + up.to(tl.float32)) * 0.001953125
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def quantize(x, scale, QUANT: tl.constexpr):
    y = tl.math.div_rn(x.to(tl.float32), scale[:, None])
    if QUANT == 1:
        return tl.clamp(tl.floor(y + 0.5), -127.0, 127.0)
    return _round_to_e4m3(tl.clamp(y, -448.0, 448.0))


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANT != 0:
        k_scale = tl.load(kv_scales_ptr + heads, mask=heads < NUM_HEADS, other=1.0)
        v_scale = tl.load(kv_scales_ptr + NUM_HEADS + heads, mask=heads < NUM_HEADS, other=1.0)
        k = quantize(k, k_scale, QUANT)
        v = quantize(v, v_scale, QUANT)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_cache_inputs(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> tuple[torch.Tensor | None, int]:
    """Checks key / value [T, G, D] against the caches; returns the float32 scales of a quantized cache (or None) and
    the kernels' QUANT flag."""
    _, num_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError("key/value [T, G, D] do not match the caches [num_blocks, block_size, G, D]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV caches must be contiguous in the head dimension")
    scales = check_kv_scales(k_cache, kv_scales)
    if scales is None:
        return None, _NO_QUANT
    return scales.float().contiguous(), _INT8 if k_cache.dtype == torch.int8 else _FP8


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes key/value [T, G, D] into the pages at slot_mapping [T], in place; negative slots are skipped.
    An int8 / float8_e4m3fn cache stores key / kv_scales[0] and value / kv_scales[1] (per KV head), rounded."""
    num_tokens, num_heads, head_dim = key.shape
    scales, quant = check_cache_inputs(key, value, k_cache, v_cache, kv_scales)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    head_dim_pad = triton.next_power_of_2(head_dim)
    heads_pad = triton.next_power_of_2(num_heads)
    _store_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key if scales is None else scales,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        QUANT=quant,
        num_warps=max(1, min(8, heads_pad * head_dim_pad // 256)),
        **launch_options(key),
    )
