"""Variable-length causal attention of new tokens over the paged KV cache (prefill, chunked prefill,
prefix caching). The new tokens' K/V are already in the cache; a sequence's new tokens are the last
q_len positions of its context, so a cached prefix is read from its pages like any other block.
An int8 / fp8 cache is converted in registers; its per-KV-head scales multiply the scores (K) and the
output (V).

Grid: (query tiles over all sequences, query heads). A program finds its sequence from
query_start_loc on the device, so the launch needs no host synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_tile
from kernels.flash_decode import check_paged_inputs, kv_scale_args

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Values that change from step to step are not specialised on: each new specialisation would compile
# mid-serving (seconds on a cold cache).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    kv_scales_ptr,
    qk_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    if KV_QUANT:
        qk_scale = qk_scale * tl.load(kv_scales_ptr + kv_head)

    # Sequence i owns tiles starting at query_start_loc[i] // BLOCK_M + i: increasing in i, and with
    # room for cdiv(q_len_i, BLOCK_M) tiles before the next sequence's first tile.
    seq_ids = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_loc_ptr + seq_ids, mask=seq_ids < num_seqs, other=0).to(tl.int32)
    first_tiles = starts // BLOCK_M + seq_ids
    seq = tl.sum(((first_tiles <= tile_id) & (seq_ids < num_seqs)).to(tl.int32), axis=0) - 1
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    local_tile = tile_id - (q_start // BLOCK_M + seq)
    if local_tile * BLOCK_M >= q_len:
        return

    prefix = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
    rows = local_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = prefix + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    if HEAD_DIM == HEAD_DIM_PAD:
        q_mask = row_mask[:, None]
    else:
        q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    token = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_kh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Key tiles wholly at or before this tile's first query position need no mask.
    first_pos = prefix + local_tile * BLOCK_M
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum((local_tile + 1) * BLOCK_M, q_len)
    for tile in range(0, unmasked_end, BLOCK_N):
        m, l, acc = attend_tile(
            q, m, l, acc, k_head, v_head, table, tile, q_pos, kv_end, qk_scale,
            stride_kb, stride_ks, dims,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, KV_QUANT,
        )
    for tile in range(unmasked_end, kv_end, BLOCK_N):
        m, l, acc = attend_tile(
            q, m, l, acc, k_head, v_head, table, tile, q_pos, kv_end, qk_scale,
            stride_kb, stride_ks, dims,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION, KV_QUANT,
        )

    out = acc / l[:, None]
    if KV_QUANT:
        out = out * tl.load(kv_scales_ptr + NUM_KV_HEADS + kv_head)
    tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _seqs_pad(num_seqs: int) -> int:
    """Two buckets up to 256 sequences rather than one compiled variant per power of two."""
    return 16 if num_seqs <= 16 else max(256, triton.next_power_of_2(num_seqs))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens q [T, H, D] over its whole paged context.
    Sequence i's rows query_start_loc[i]:query_start_loc[i+1] are the last tokens of its
    seq_lens[i]-token context. Returns [T, H, D]. An int8 / fp8 cache needs kv_scales [2, G]."""
    cfg = config or PrefillConfig()
    q, block_tables = check_paged_inputs(q, k_cache, v_cache, block_tables)
    scales_arg, kv_quant = kv_scale_args(q, k_cache, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // cfg.block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scales_arg,
        scale * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SEQS_PAD=_seqs_pad(num_seqs),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_KV_HEADS=num_kv_heads,
        KV_QUANT=kv_quant,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
