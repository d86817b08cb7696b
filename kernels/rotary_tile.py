"""Rotary embedding of one token's heads as a [rows, head_dim] tile, for a kernel that rotates q and k itself
instead of running kernels/rotary_store.py first (decode attention). The arithmetic is kernels/rotary.py's:
float32, rotate-half, each output element x * cos -/+ its partner * sin."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cos_sin_tile(positions_ptr, token, cos_sin_ptr, stride_cos, dims, HALF: tl.constexpr):
    """cos and sin [1, 2 * HALF] (float32) of one token's position, each frequency repeated for both halves."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    freq = dims % HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos + freq).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + freq).to(tl.float32)
    return cos[None, :], sin[None, :]


@triton.jit
def rotated_tile(src, row_offsets, row_mask, dims, cos, sin, HALF: tl.constexpr):
    """Rows src + row_offsets [R] of 2 * HALF elements, rotated (float32 [R, 2 * HALF]; masked rows are 0)."""
    partner = (dims + HALF) % (2 * HALF)
    rows = src + row_offsets[:, None]
    x = tl.load(rows + dims[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    return tl.where((dims < HALF)[None, :], x * cos - x_partner * sin, x * cos + x_partner * sin)
