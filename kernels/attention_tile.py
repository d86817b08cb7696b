"""One key/value tile of online-softmax attention over the paged cache, shared by the decode and
prefill kernels: reads BLOCK_N cached tokens from position `tile` on, folds them into (m, l, acc).
K and V share one layout (check_paged_inputs), so one set of offsets addresses both.

When BLOCK_SIZE divides BLOCK_N (tiles then start on page boundaries), the tile's page ids are read
once per page rather than once per token. MASKED drops tokens at or past kv_end; CAUSAL also drops
those after each query row's position q_pos.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q,
    m,
    l,
    acc,
    k_head,
    v_head,
    table,
    tile,
    q_pos,
    kv_end,
    qk_scale,
    stride_b,
    stride_s,
    dims,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    kv_pos = tile + offs_n
    in_range = kv_pos < kv_end
    if BLOCK_N % BLOCK_SIZE == 0:
        PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
        page_idx = tile // BLOCK_SIZE + tl.arange(0, PAGES)
        if MASKED:
            pages = tl.load(table + page_idx, mask=page_idx * BLOCK_SIZE < kv_end, other=0)
        else:
            pages = tl.load(table + page_idx)
        page = tl.reshape(tl.broadcast_to(pages[:, None], [PAGES, BLOCK_SIZE]), [BLOCK_N]).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
    else:
        if MASKED:
            page = tl.load(table + kv_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        else:
            page = tl.load(table + kv_pos // BLOCK_SIZE).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
    offsets = page[:, None] * stride_b + slot[:, None] * stride_s + dims[None, :]
    k_ptrs = k_head + offsets
    v_ptrs = v_head + offsets
    if MASKED:
        if HEAD_DIM == HEAD_DIM_PAD:
            kv_mask = in_range[:, None]
        else:
            kv_mask = in_range[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    if KV_QUANT:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where((kv_pos[None, :] <= q_pos[:, None]) & in_range[None, :], s, float("-inf"))
    elif MASKED:
        s = tl.where(in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc
