"""LoRA expand: y += shrunk @ B^T, each token with its adapter's B, added into the base projection's output in place
(Punica's expand). A fused projection (q|k|v, gate|up) has one slice per part: slice i's output columns
slice_offsets[i]:slice_offsets[i + 1] take ranks i*R:(i+1)*R of the shrunk rows.

SGMV form (prefill): one program per (segment, block of its rows, slice and block of columns), a tl.dot over the rank;
BGMV form (decode): one program per (token, slice, block of columns). b_stack [S, N, R] holds every slot's B with the
adapter's scaling folded in; base-model tokens (slot -1) are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_indices import LoRAIndices


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
    R,
    stride_ym, stride_yn, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    slice_index = tl.program_id(1)
    col_start = tl.load(slice_offsets_ptr + slice_index)
    col_end = tl.load(slice_offsets_ptr + slice_index + 1)
    cols = col_start + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (slot >= 0) & (col_start + tl.program_id(2) * BLOCK_N < col_end):
        ranks = tl.arange(0, BLOCK_R)
        col_ok = cols < col_end
        s = tl.load(s_ptr + token * stride_sm + (slice_index * R + ranks) * stride_sr, mask=ranks < R, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :] * stride_br,
                    mask=col_ok[:, None] & (ranks[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.sum(b * s[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_ym + cols * stride_yn
        y = tl.load(y_ptrs, mask=col_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def _widest_slice(slice_offsets: list[int]) -> int:
    return max(b - a for a, b in zip(slice_offsets[:-1], slice_offsets[1:]))


def sgmv_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_stack: torch.Tensor, indices: LoRAIndices,
                 slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int) -> None:
    if y.shape[0] == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_m = max(16, min(64, triton.next_power_of_2(indices.max_seg_len)))
    block_n = 64
    blocks_per_slice = triton.cdiv(_widest_slice(slice_offsets_host), block_n)
    grid = (indices.num_segments, triton.cdiv(indices.max_seg_len, block_m),
            (len(slice_offsets_host) - 1) * blocks_per_slice)
    _sgmv_expand_kernel[grid](
        y, shrunk, b_stack, indices.seg_starts, indices.seg_slots, slice_offsets, rank, blocks_per_slice,
        y.stride(0), y.stride(1), shrunk.stride(0), shrunk.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION="ieee", num_warps=4,
    )


def bgmv_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_stack: torch.Tensor, indices: LoRAIndices,
                 slice_offsets: torch.Tensor, slice_offsets_host: list[int], rank: int) -> None:
    if y.shape[0] == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 128
    grid = (y.shape[0], len(slice_offsets_host) - 1, triton.cdiv(_widest_slice(slice_offsets_host), block_n))
    _bgmv_expand_kernel[grid](
        y, shrunk, b_stack, indices.token_slots, slice_offsets, rank,
        y.stride(0), y.stride(1), shrunk.stride(0), shrunk.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4,
    )
