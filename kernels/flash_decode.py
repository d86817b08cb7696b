"""Decode attention over the paged KV cache: split-K flash-decoding, GQA-aware.

One program serves all query heads of one KV head of one sequence over one split of its context,
so each K/V tile is read once for the whole group. An int8 / fp8 cache is read as stored and
converted in registers; its per-KV-head scales multiply the scores (K) and the output (V). With several splits, a second kernel combines
the partial results. The split count depends only on shapes (never on seq_lens' values), so the
launch needs no host synchronisation and can be captured in a CUDA graph.

`rotary_decode_attention` also does kernels/rotary_store.py's work: each program rotates its q heads, and the
program whose split holds the new token writes the token's rotated k and its v into the cache before reading its
tiles. A decode step then launches one kernel fewer a layer (batch-1 Llama-3-8B on an H200: 246 -> 249.5 tok/s).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_tile
from kernels.cache_ops import check_cache_inputs, quantize
from kernels.pdl import launch_options, let_later_kernels_launch, wait_for_earlier_kernels
from kernels.kv_layout import check_kv_scales
from kernels.rotary import check_rotary_inputs
from kernels.rotary_tile import cos_sin_tile, rotated_tile

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters. num_splits=None picks the split count from the shapes."""

    block_n: int = 64
    num_warps: int = 2
    num_stages: int = 3
    num_splits: int | None = None
    programs_per_sm: int = 2
    min_split_tokens: int = 256
    max_splits: int = 64


@triton.jit
def _store_new_token(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, token, kv_head, slot, rows, dims,
                     cos, sin, stride_nt, stride_nh, stride_vt, stride_vh, stride_kb, stride_ks, stride_kh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     QUANT: tl.constexpr):
    """One KV head of one token: k rotated and rounded to k's dtype, then (like v) quantized for an int8 / fp8
    cache, written to its page slot. Tiles of the program's rows; only row 0 is read and written."""
    first = rows == 0
    k = rotated_tile(k_new_ptr + token * stride_nt + kv_head * stride_nh, rows * 0, first, dims, cos, sin,
                     HEAD_DIM // 2).to(k_new_ptr.dtype.element_ty)
    v = tl.load(v_new_ptr + token * stride_vt + kv_head * stride_vh + rows[:, None] * 0 + dims[None, :],
                mask=first[:, None], other=0.0)
    if QUANT != 0:
        k = quantize(k, tl.load(kv_scales_ptr + kv_head + rows * 0), QUANT)
        v = quantize(v, tl.load(kv_scales_ptr + NUM_KV_HEADS + kv_head + rows * 0), QUANT)
    page = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    tl.store(k_cache_ptr + page + rows[:, None] * 0 + dims[None, :], k.to(k_cache_ptr.dtype.element_ty),
             mask=first[:, None])
    tl.store(v_cache_ptr + page + rows[:, None] * 0 + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=first[:, None])


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    kv_scales_ptr,
    qk_scale,
    split_len,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ob,
    stride_oh,
    positions_ptr,
    k_new_ptr,
    v_new_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    stride_nt,
    stride_nh,
    stride_vt,
    stride_vh,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    ROTARY: tl.constexpr = False,
    STORE_QUANT: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    # KV heads vary fastest: the heads of one sequence run together and read neighbouring pages.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    if KV_QUANT:
        qk_scale = qk_scale * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + NUM_HEADS // GROUP + kv_head)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    if HEAD_DIM == HEAD_DIM_PAD:
        q_mask = row_mask[:, None]
    else:
        q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    if ROTARY:
        # q is not rotated yet, and the new token's k and v are not in the cache: the split that holds the
        # token's position writes them there (as kernels/rotary_store.py would) before its tiles read them.
        cos, sin = cos_sin_tile(positions_ptr, seq, cos_sin_ptr, stride_cos, dims, HEAD_DIM // 2)
        q = rotated_tile(q_ptr + seq.to(tl.int64) * stride_qb, heads * stride_qh, row_mask, dims, cos, sin,
                         HEAD_DIM // 2).to(q_ptr.dtype.element_ty)
        last = seq_len - 1
        if (last >= start) & (last < start + split_len):
            slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
            if slot >= 0:
                _store_new_token(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, seq.to(tl.int64),
                                 kv_head, slot, rows, dims, cos, sin, stride_nt, stride_nh, stride_vt, stride_vh,
                                 stride_kb, stride_ks, stride_kh, NUM_HEADS // GROUP, HEAD_DIM, BLOCK_SIZE,
                                 STORE_QUANT)
                tl.debug_barrier()  # the whole program's stores are visible to its loads after this
    else:
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                    other=0.0)

    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_kh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for tile in range(start, full_end, BLOCK_N):
        m, l, acc = attend_tile(
            q, m, l, acc, k_head, v_head, table, tile, rows, end, qk_scale,
            stride_kb, stride_ks, dims,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, KV_QUANT,
        )
    if full_end < end:
        m, l, acc = attend_tile(
            q, m, l, acc, k_head, v_head, table, full_end, rows, end, qk_scale,
            stride_kb, stride_ks, dims,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION, KV_QUANT,
        )

    if HEAD_DIM == HEAD_DIM_PAD:
        o_mask = row_mask[:, None]
    else:
        o_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    if KV_QUANT:
        acc = acc * v_scale
    let_later_kernels_launch(EARLY)
    if SINGLE_SPLIT:
        out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        out_rows = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=o_mask)
        tl.store(part_m_ptr + part, m, mask=row_mask)
        tl.store(part_l_ptr + part, l, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    # An empty split has m = -inf; all splits are empty only for a sequence of length 0 (output 0).
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    let_later_kernels_launch(EARLY)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks q [N, H, D] against caches [num_blocks, block_size, G, D]; returns q and block_tables
    with unit stride in their last dimension, as the kernels index them. Use kv_scale_args for the scales."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, kv_dim = k_cache.shape[2], k_cache.shape[3]
    if kv_dim != head_dim or v_cache.shape != k_cache.shape or num_heads % num_kv_heads:
        raise ValueError("q [N, H, D] and caches [num_blocks, block_size, G, D] need matching D and H % G == 0")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV caches must be contiguous in the head dimension")
    if v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must share one layout (equal strides)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return q, block_tables


def kv_scale_args(q: torch.Tensor, k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """(the scales pointer argument, KV_QUANT) for a kernel launch: the [2, G] float32 scales of a
    quantized cache, or q as an unused placeholder."""
    scales = check_kv_scales(k_cache, kv_scales)
    if scales is None:
        return q, False
    return scales.float().contiguous(), True


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, config: DecodeConfig) -> int:
    """Enough splits that batch * num_kv_heads * splits programs fill the SMs, each split at least
    config.min_split_tokens long."""
    if config.num_splits is not None:
        return max(1, config.num_splits)
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(config.programs_per_sm * num_sms, programs)
    by_length = max(1, max_context // config.min_split_tokens)
    return max(1, min(wanted, by_length, config.max_splits))


# Few sequences (batch-1 decode: 4 to 8 programs without splits): one 128-token tile per split, read by 4 warps, so
# the context spreads over the SMs. At batch 1 on an H200 a layer's attention went from 6.5-8.7 us to 5.0-6.3 us
# (contexts 256-2k, graph replays; BENCHMARKS.md, "decode GEMV and batch-1 attention").
SMALL_BATCH_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_split_tokens=128)


def default_config(batch: int, num_kv_heads: int, num_sms: int) -> DecodeConfig:
    return SMALL_BATCH_CONFIG if 4 * batch * num_kv_heads <= num_sms else DecodeConfig()


@dataclass(frozen=True)
class NewTokens:
    """What decode attention needs to rotate q itself and to put the new tokens' k and v into the cache."""

    positions: torch.Tensor  # [B]
    k: torch.Tensor  # [B, G, D], not rotated
    v: torch.Tensor  # [B, G, D]
    cos_sin_cache: torch.Tensor  # [max_position, D]
    slot_mapping: torch.Tensor  # [B]; negative: not stored
    quant: int  # the cache's kind, as kernels/cache_ops.py names it (0: stored as is)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] attends to the first seq_lens[b] cached tokens of the
    pages in block_tables[b]. Returns [B, H, D]. The longest context is bounded by
    block_tables.shape[1] * block_size, which sets the split count without reading seq_lens.
    An int8 / fp8 cache needs kv_scales [2, G] (see kernels/kv_layout.py)."""
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales, config, None)


def rotary_decode_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """rotary_kv_store (kernels/rotary_store.py), then decode_attention of the rotated q, in one kernel launch
    (two with splits): q [B, H, D], k and v [B, G, D] are the new tokens, one per sequence, not yet rotated or
    stored; seq_lens counts them. Needs an even head_dim that is a power of two (`fuses_rotary`)."""
    if not fuses_rotary(q.shape[-1]):
        raise ValueError(f"q: head_dim {q.shape[-1]} is not a power of two >= 16; rotate and store separately")
    check_rotary_inputs(q, k, cos_sin_cache)
    if not q.shape[0] == positions.shape[0] == slot_mapping.shape[0]:
        raise ValueError("q, k, positions and slot_mapping need one row per sequence")
    quant = check_cache_inputs(k, v, k_cache, v_cache, kv_scales)[1]
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    new = NewTokens(positions, k, v, cos_sin, slot_mapping, quant)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales, config, new)


def fuses_rotary(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_scales, config, new: NewTokens | None):
    q, block_tables = check_paged_inputs(q, k_cache, v_cache, block_tables)
    scales_arg, kv_quant = kv_scale_args(q, k_cache, kv_scales)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_sms = _device_sms(q.device)
    cfg = config or default_config(batch, num_kv_heads, num_sms)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    max_context = block_tables.shape[1] * block_size
    num_splits = choose_num_splits(batch, num_kv_heads, max_context, num_sms, cfg)
    split_len = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), cfg.block_n) * cfg.block_n
    num_splits = max(1, triton.cdiv(max_context, split_len))
    single = num_splits == 1
    if single:
        part_acc = part_m = part_l = out
    else:
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    if new is None:  # placeholders the kernel never reads
        new_args = (seq_lens, q, q, q, seq_lens, 0, 0, 0, 0, 0)
    else:
        new_args = (new.positions, new.k, new.v, new.cos_sin_cache, new.slot_mapping, new.k.stride(0),
                    new.k.stride(1), new.v.stride(0), new.v.stride(1), new.cos_sin_cache.stride(0))
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        scales_arg,
        scale * LOG2E,
        split_len,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *new_args,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        SINGLE_SPLIT=single,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_QUANT=kv_quant,
        ROTARY=new is not None,
        STORE_QUANT=0 if new is None else new.quant,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(q, early=True),
    )
    if not single:
        _decode_reduce_kernel[(batch, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
            **launch_options(q, early=True),
        )
    return out
