"""LoRA expand: y += shrunk @ B^T, each token with its adapter's B, added into the base projection's output in place
(Punica's expand). A fused projection (q|k|v, gate|up) has one slice per part: slice i's output columns
slice_offsets[i]:slice_offsets[i + 1] take ranks i*R:(i+1)*R of the shrunk rows.

SGMV form (prefill): one program per (segment, block of its rows, slice and block of columns), a tl.dot over the rank;
BGMV form (decode): one program per (token, slice, block of columns), which first adds up the shrink's split-K
partial sums for its token (and applies a fused norm's 1 / RMS); grouped form (decode steps whose tokens share
adapters): one program per (slot, slice, block of columns), which loads its block of the slot's B once and loops
over the slot's tokens (LoRAIndices.sorted_rows) in blocks, each a tl.dot over the rank; its grid is fixed by the
pool's size, and slots no token uses exit at once. b_stack [S, N, R] holds every slot's B with the adapter's scaling
folded in, read through its strides (the slot pool's is a transposed view of rank-major storage, which the dense
form of kernels/punica_dense.py needs); base-model tokens (slot -1) are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_configs import (
    bgmv_expand_config,
    bgmv_expand_silu_config,
    expand_rank_block,
    grouped_expand_config,
    grouped_expand_silu_config,
)
from kernels.lora_indices import LoRAIndices
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.punica_shrink import SplitShrunk
from kernels.segment_grid import segment_grid


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, s_ptr, b_ptr, seg_starts_ptr, seg_slots_ptr, slice_offsets_ptr,
    R, BLOCKS_PER_SLICE,
    stride_ym, stride_yn, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    first_row = start + tl.program_id(1) * BLOCK_M
    piece = tl.program_id(2)
    slice_index = piece // BLOCKS_PER_SLICE
    col_start = tl.load(slice_offsets_ptr + slice_index)
    col_end = tl.load(slice_offsets_ptr + slice_index + 1)
    cols = col_start + (piece % BLOCKS_PER_SLICE) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (slot >= 0) & (first_row < end) & (col_start + (piece % BLOCKS_PER_SLICE) * BLOCK_N < col_end):
        rows = first_row + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        row_ok = rows < end
        col_ok = cols < col_end
        s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sm + (slice_index * R + ranks[None, :]) * stride_sr,
                    mask=row_ok[:, None] & (ranks[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                    mask=col_ok[None, :] & (ranks[:, None] < R), other=0.0)
        delta = tl.dot(s, b.to(tl.float32), input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, s_ptr, b_ptr, token_slots_ptr, slice_offsets_ptr,
    R, NUM_SPLITS, SQUARES_COL, K, eps,
    stride_ym, stride_yn, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    slice_index = tl.program_id(1)
    col_start = tl.load(slice_offsets_ptr + slice_index)
    col_end = tl.load(slice_offsets_ptr + slice_index + 1)
    cols = col_start + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (slot >= 0) & (col_start + tl.program_id(2) * BLOCK_N < col_end):
        ranks = tl.arange(0, BLOCK_R)
        col_ok = cols < col_end
        row = s_ptr + token * stride_sm
        s = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for split in range(0, NUM_SPLITS):
            s += tl.load(row + split * stride_ss + (slice_index * R + ranks) * stride_sr, mask=ranks < R, other=0.0)
        if NORM:
            squares = tl.zeros((1,), dtype=tl.float32)
            for split in range(0, NUM_SPLITS):
                squares += tl.load(row + split * stride_ss + (SQUARES_COL + tl.arange(0, 1)) * stride_sr)
            s = s * tl.rsqrt(squares / K + eps)
        b = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :] * stride_br,
                    mask=col_ok[:, None] & (ranks[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.sum(b * s[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_ym + cols * stride_yn
        y = tl.load(y_ptrs, mask=col_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _bgmv_expand_silu_kernel(
    y_ptr, out_ptr, s_ptr, b_ptr, token_slots_ptr,
    N, R, NUM_SPLITS, SQUARES_COL, K, eps,
    stride_ym, stride_yn, stride_om, stride_on, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gate = tl.load(y_ptr + token * stride_ym + cols * stride_yn, mask=col_ok, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + token * stride_ym + (N + cols) * stride_yn, mask=col_ok, other=0.0).to(tl.float32)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        row = s_ptr + token * stride_sm
        s_gate = tl.zeros((BLOCK_R,), dtype=tl.float32)
        s_up = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for split in range(0, NUM_SPLITS):
            s_gate += tl.load(row + split * stride_ss + ranks * stride_sr, mask=rank_ok, other=0.0)
            s_up += tl.load(row + split * stride_ss + (R + ranks) * stride_sr, mask=rank_ok, other=0.0)
        if NORM:
            squares = tl.zeros((1,), dtype=tl.float32)
            for split in range(0, NUM_SPLITS):
                squares += tl.load(row + split * stride_ss + (SQUARES_COL + tl.arange(0, 1)) * stride_sr)
            scale = tl.rsqrt(squares / K + eps)
            s_gate = s_gate * scale
            s_up = s_up * scale
        b_rows = b_ptr + slot * stride_bs + ranks[None, :] * stride_br
        b_mask = col_ok[:, None] & rank_ok[None, :]
        b_gate = tl.load(b_rows + cols[:, None] * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
        b_up = tl.load(b_rows + (N + cols[:, None]) * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
        gate += tl.sum(b_gate * s_gate[None, :], axis=1)
        up += tl.sum(b_up * s_up[None, :], axis=1)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + token * stride_om + cols * stride_on, (silu * up).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _summed_partials(s_ptr, rows, row_ok, first_rank, R, NUM_SPLITS, SQUARES_COL, K, eps,
                     stride_ss, stride_sm, stride_sr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr):
    """[BLOCK_M, BLOCK_R] float32: ranks first_rank:first_rank + R of the rows' shrunk values, their split-K partial
    sums added up (times 1 / RMS with a fused norm); zeros on rows past row_ok."""
    ranks = tl.arange(0, BLOCK_R)
    base = s_ptr + rows[:, None] * stride_sm
    mask = row_ok[:, None] & (ranks[None, :] < R)
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(0, NUM_SPLITS):
        s += tl.load(base + split * stride_ss + (first_rank + ranks[None, :]) * stride_sr, mask=mask, other=0.0)
    if NORM:
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for split in range(0, NUM_SPLITS):
            squares += tl.load(s_ptr + rows * stride_sm + split * stride_ss + SQUARES_COL * stride_sr, mask=row_ok,
                               other=0.0)
        s = s * tl.rsqrt(squares / K + eps)[:, None]
    return s


@triton.jit
def _grouped_expand_kernel(
    y_ptr, s_ptr, b_ptr, sorted_rows_ptr, group_starts_ptr, slice_offsets_ptr,
    R, NUM_SPLITS, SQUARES_COL, K, eps,
    stride_ym, stride_yn, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    slot = tl.program_id(0)
    start = tl.load(group_starts_ptr + slot)
    end = tl.load(group_starts_ptr + slot + 1)
    slice_index = tl.program_id(1)
    col_start = tl.load(slice_offsets_ptr + slice_index)
    col_end = tl.load(slice_offsets_ptr + slice_index + 1)
    cols = col_start + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (end > start) & (col_start + tl.program_id(2) * BLOCK_N < col_end):
        ranks = tl.arange(0, BLOCK_R)
        col_ok = cols < col_end
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                    mask=col_ok[None, :] & (ranks[:, None] < R), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            row_ok = pos < end
            rows = tl.load(sorted_rows_ptr + pos, mask=row_ok, other=0).to(tl.int64)
            s = _summed_partials(s_ptr, rows, row_ok, slice_index * R, R, NUM_SPLITS, SQUARES_COL, K, eps,
                                 stride_ss, stride_sm, stride_sr, BLOCK_M, BLOCK_R, NORM)
            delta = tl.dot(s, b, input_precision=PRECISION)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
            mask = row_ok[:, None] & col_ok[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_expand_silu_kernel(
    y_ptr, out_ptr, s_ptr, b_ptr, sorted_rows_ptr, group_starts_ptr,
    N, R, NUM_SLOTS, NUM_SPLITS, SQUARES_COL, K, eps,
    stride_ym, stride_yn, stride_om, stride_on, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """Groups 0..NUM_SLOTS-1 are the slots, group NUM_SLOTS the base-model rows (the product alone): every row of
    out is written."""
    wait_for_earlier_kernels(PDL)
    group = tl.program_id(0)
    start = tl.load(group_starts_ptr + group)
    end = tl.load(group_starts_ptr + group + 1)
    if end > start:
        is_lora = group < NUM_SLOTS
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ranks = tl.arange(0, BLOCK_R)
        b_rows = b_ptr + group.to(tl.int64) * stride_bs + ranks[:, None] * stride_br
        lora_ranks = (ranks * 0 + group < NUM_SLOTS) & (ranks < R)  # the base-model group reads no B
        b_mask = col_ok[None, :] & lora_ranks[:, None]
        b_gate = tl.load(b_rows + cols[None, :] * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
        b_up = tl.load(b_rows + (N + cols[None, :]) * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            row_ok = pos < end
            rows = tl.load(sorted_rows_ptr + pos, mask=row_ok, other=0).to(tl.int64)
            mask = row_ok[:, None] & col_ok[None, :]
            y_rows = y_ptr + rows[:, None] * stride_ym
            gate = tl.load(y_rows + cols[None, :] * stride_yn, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(y_rows + (N + cols[None, :]) * stride_yn, mask=mask, other=0.0).to(tl.float32)
            if is_lora:
                s_gate = _summed_partials(s_ptr, rows, row_ok, 0, R, NUM_SPLITS, SQUARES_COL, K, eps,
                                          stride_ss, stride_sm, stride_sr, BLOCK_M, BLOCK_R, NORM)
                s_up = _summed_partials(s_ptr, rows, row_ok, R, R, NUM_SPLITS, SQUARES_COL, K, eps,
                                        stride_ss, stride_sm, stride_sr, BLOCK_M, BLOCK_R, NORM)
                gate += tl.dot(s_gate, b_gate, input_precision=PRECISION)
                up += tl.dot(s_up, b_up, input_precision=PRECISION)
            silu = gate / (1.0 + tl.exp(-gate))
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                     (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _widest_slice(slice_offsets: list[int]) -> int:
    return max(b - a for a, b in zip(slice_offsets[:-1], slice_offsets[1:]))


def sgmv_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_stack: torch.Tensor, indices: LoRAIndices,
                 slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int) -> None:
    if y.shape[0] == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_m, rows_grid = segment_grid(indices)
    block_n = 64
    blocks_per_slice = triton.cdiv(_widest_slice(slice_offsets_host), block_n)
    grid = (*rows_grid, (len(slice_offsets_host) - 1) * blocks_per_slice)
    _sgmv_expand_kernel[grid](
        y, shrunk, b_stack, indices.seg_starts, indices.seg_slots, slice_offsets, rank, blocks_per_slice,
        y.stride(0), y.stride(1), shrunk.stride(0), shrunk.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION="ieee", num_warps=4,
    )


def bgmv_expand_(y: torch.Tensor, shrunk: SplitShrunk, b_stack: torch.Tensor, indices: LoRAIndices,
                 slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int, *,
                 block_n: int | None = None, num_warps: int | None = None) -> None:
    """The keywords override kernels/lora_configs.py's bgmv_expand_config (None: its default)."""
    if y.shape[0] == 0:
        return
    widest = _widest_slice(slice_offsets_host)
    cfg = bgmv_expand_config(widest, rank, block_n=block_n, num_warps=num_warps)
    block_r = expand_rank_block(rank)
    partials = shrunk.partials
    grid = (y.shape[0], len(slice_offsets_host) - 1, triton.cdiv(widest, cfg.block_n))
    _bgmv_expand_kernel[grid](
        y, partials, b_stack, indices.token_slots, slice_offsets, rank, partials.shape[0], partials.shape[2] - 1,
        shrunk.k, 0.0 if shrunk.eps is None else shrunk.eps,
        y.stride(0), y.stride(1), partials.stride(0), partials.stride(1), partials.stride(2),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_N=cfg.block_n, BLOCK_R=block_r, NORM=shrunk.eps is not None, num_warps=cfg.num_warps,
        **launch_options(y),
    )


def bgmv_expand_silu_and_mul(y: torch.Tensor, shrunk: SplitShrunk, b_stack: torch.Tensor, indices: LoRAIndices,
                             rank: int, *, block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up projection's output y [T, 2N], each token's LoRA term added to both halves
    first (slices 0 and 1 of the shrunk rows and b_stack [S, 2N, R]) -> [T, N]: the expand and the SiLU product in
    one kernel, base-model tokens' rows taking the product alone. The keywords override kernels/lora_configs.py's
    bgmv_expand_silu_config (None: its default)."""
    num_tokens, n = y.shape[0], y.shape[1] // 2
    out = torch.empty(num_tokens, n, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or n == 0:
        return out
    cfg = bgmv_expand_silu_config(n, rank, block_n=block_n, num_warps=num_warps)
    block_r = expand_rank_block(rank)
    partials = shrunk.partials
    _bgmv_expand_silu_kernel[(num_tokens, triton.cdiv(n, cfg.block_n))](
        y, out, partials, b_stack, indices.token_slots, n, rank, partials.shape[0], partials.shape[2] - 1,
        shrunk.k, 0.0 if shrunk.eps is None else shrunk.eps,
        y.stride(0), y.stride(1), out.stride(0), out.stride(1), partials.stride(0), partials.stride(1),
        partials.stride(2), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_N=cfg.block_n, BLOCK_R=block_r, NORM=shrunk.eps is not None, num_warps=cfg.num_warps,
        **launch_options(y),
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_grouped(indices: LoRAIndices, b_stack: torch.Tensor, num_tokens: int) -> None:
    if indices.sorted_rows is None or indices.num_slots != b_stack.shape[0]:
        raise ValueError(f"the grouped expand needs the grouped form of {b_stack.shape[0]} slots")
    if indices.sorted_rows.shape[0] != num_tokens:
        raise ValueError(f"grouped form of {indices.sorted_rows.shape[0]} rows for {num_tokens} tokens")


def grouped_expand_(y: torch.Tensor, shrunk: SplitShrunk, b_stack: torch.Tensor, indices: LoRAIndices,
                    slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int, *,
                    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None) -> None:
    """bgmv_expand_ in the grouped form: each program reads one block of one slot's B for all of the slot's tokens.
    The keywords override kernels/lora_configs.py's grouped_expand_config (None: its default)."""
    _check_grouped(indices, b_stack, y.shape[0])
    if y.shape[0] == 0 or b_stack.shape[0] == 0:
        return
    widest = _widest_slice(slice_offsets_host)
    cfg = grouped_expand_config(widest, rank, block_m=block_m, block_n=block_n, num_warps=num_warps)
    block_r = expand_rank_block(rank)
    partials = shrunk.partials
    grid = (b_stack.shape[0], len(slice_offsets_host) - 1, triton.cdiv(widest, cfg.block_n))
    _grouped_expand_kernel[grid](
        y, partials, b_stack, indices.sorted_rows, indices.group_starts, slice_offsets, rank, partials.shape[0],
        partials.shape[2] - 1, shrunk.k, 0.0 if shrunk.eps is None else shrunk.eps,
        y.stride(0), y.stride(1), partials.stride(0), partials.stride(1), partials.stride(2),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, NORM=shrunk.eps is not None,
        PRECISION=_precision(y.dtype), num_warps=cfg.num_warps, **launch_options(y),
    )


def grouped_expand_silu_and_mul(y: torch.Tensor, shrunk: SplitShrunk, b_stack: torch.Tensor, indices: LoRAIndices,
                                rank: int, *, block_m: int | None = None, block_n: int | None = None,
                                num_warps: int | None = None) -> torch.Tensor:
    """bgmv_expand_silu_and_mul in the grouped form: one program per (slot, block of N columns) adds the slot's
    tokens' LoRA terms to both halves and writes the product; one more group of programs writes the base-model
    rows' product alone. The keywords override kernels/lora_configs.py's grouped_expand_silu_config (None: its
    default)."""
    _check_grouped(indices, b_stack, y.shape[0])
    num_tokens, n = y.shape[0], y.shape[1] // 2
    out = torch.empty(num_tokens, n, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or n == 0:
        return out
    cfg = grouped_expand_silu_config(n, rank, block_m=block_m, block_n=block_n, num_warps=num_warps)
    block_r = expand_rank_block(rank)
    partials = shrunk.partials
    num_slots = b_stack.shape[0]
    _grouped_expand_silu_kernel[(num_slots + 1, triton.cdiv(n, cfg.block_n))](
        y, out, partials, b_stack, indices.sorted_rows, indices.group_starts, n, rank, num_slots, partials.shape[0],
        partials.shape[2] - 1, shrunk.k, 0.0 if shrunk.eps is None else shrunk.eps,
        y.stride(0), y.stride(1), out.stride(0), out.stride(1), partials.stride(0), partials.stride(1),
        partials.stride(2), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, NORM=shrunk.eps is not None,
        PRECISION=_precision(y.dtype), num_warps=cfg.num_warps, **launch_options(y),
    )
    return out
