"""LoRA expand as dense GEMMs over the whole slot pool, for decode steps whose tokens use most of the pool's slots.

Each token's shrunk row (the grouped or per-token shrink's split partial sums, added up and scaled by the fused
norm's 1 / RMS) is placed in its slot's columns of a [T, slices, S * rank] matrix, zeros in every other slot's (one
small kernel, launched on the shrink's stream so it stays beside the base projection); each slice of the projection's
output then takes one cuBLAS GEMM against every slot's B of that slice stacked along its rows: b_stack's rank-major
storage [S, rank, N] read as [S * rank, N_i]. It reads every slot's B where the grouped expand reads only the used
slots', and multiplies by zeros for the other slots, but at 64 tokens over 16 slots of an 8B model's o, gate|up and
down projections the GEMMs beat the grouped Triton expand (docs/benchmarks/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_configs import expand_rank_block
from kernels.lora_indices import LoRAIndices
from kernels.punica_shrink import SplitShrunk, on_stream


@triton.jit
def _dense_rows_kernel(
    s_ptr, out_ptr, token_slots_ptr,
    R, NUM_SLOTS, NUM_SPLITS, SQUARES_COL, K, eps,
    stride_ss, stride_sm, stride_sr, stride_om, stride_oi, stride_os,
    BLOCK_R: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slice_index = tl.program_id(1)
    slot = tl.load(token_slots_ptr + token)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:  # a base-model token's partials are left unwritten by the shrinks: never read them
        row = s_ptr + token * stride_sm
        for split in range(0, NUM_SPLITS):
            s += tl.load(row + split * stride_ss + (slice_index * R + ranks) * stride_sr, mask=rank_ok, other=0.0)
        if NORM:
            squares = tl.zeros((1,), dtype=tl.float32)
            for split in range(0, NUM_SPLITS):
                squares += tl.load(row + split * stride_ss + (SQUARES_COL + tl.arange(0, 1)) * stride_sr)
            s = s * tl.rsqrt(squares / K + eps)
    out = out_ptr + token * stride_om + slice_index * stride_oi
    for j in range(0, NUM_SLOTS):
        value = tl.where(ranks * 0 + j == slot, s, 0.0)
        tl.store(out + j * stride_os + ranks, value.to(out_ptr.dtype.element_ty), mask=rank_ok)


@dataclass
class DenseRows:
    """dense_rows' output [T, slices, S * rank], and the shrink's partial sums it is made from: a kernel on the
    shrink's stream may still be reading those when dense_rows returns, so they are kept until the expand (which runs
    once the current stream has waited for that stream), lest the allocator hand their memory to the current stream."""

    rows: torch.Tensor
    shrunk: SplitShrunk


def dense_rows(shrunk: SplitShrunk, indices: LoRAIndices, num_slots: int, rank: int, dtype: torch.dtype,
               stream: torch.cuda.Stream | None = None) -> DenseRows:
    """Rows [T, slices, num_slots * rank] of dtype: token t's shrunk values of slice i in columns slot * rank:
    (slot + 1) * rank of row [t, i], zeros elsewhere (all zeros for base-model tokens). stream: as the shrinks' (the
    output is allocated on the current stream, which must wait for `stream` before it reads it)."""
    partials = shrunk.partials
    num_tokens = partials.shape[1]
    num_slices = (partials.shape[2] - 1) // rank
    out = torch.empty(num_tokens, num_slices, num_slots * rank, dtype=dtype, device=partials.device)
    if num_tokens == 0:
        return DenseRows(out, shrunk)
    with on_stream(stream, partials.device):
        _dense_rows_kernel[(num_tokens, num_slices)](
            partials, out, indices.token_slots, rank, num_slots, partials.shape[0], partials.shape[2] - 1, shrunk.k,
            0.0 if shrunk.eps is None else shrunk.eps,
            partials.stride(0), partials.stride(1), partials.stride(2), out.stride(0), out.stride(1), rank,
            BLOCK_R=expand_rank_block(rank), NORM=shrunk.eps is not None, num_warps=1,
        )
    return DenseRows(out, shrunk)


def rank_major(b_stack: torch.Tensor) -> torch.Tensor:
    """b_stack [S, N, rank] as the rank-major [S, rank, N] it must be a transposed view of."""
    stacked = b_stack.transpose(1, 2)
    if not stacked.is_contiguous():
        raise ValueError("the dense LoRA expand reads b_stack [S, N, rank] as a transposed view of rank-major "
                         f"storage [S, rank, N]; got strides {tuple(b_stack.stride())}")
    return stacked


def dense_expand_(y: torch.Tensor, dense: DenseRows, b_stack: torch.Tensor, slice_offsets_host: list[int]) -> None:
    """y [T, N] += rows[:, i] @ B_i for each slice i of the projection (dense_rows' rows; B_i every slot's B of the
    slice, [S * rank, N_i]), one GEMM per slice, in place."""
    rows = dense.rows
    stacked = rank_major(b_stack)
    num_slots, rank, _ = stacked.shape
    for i, (start, end) in enumerate(zip(slice_offsets_host[:-1], slice_offsets_host[1:])):
        y[:, start:end].addmm_(rows[:, i], stacked[:, :, start:end].reshape(num_slots * rank, end - start))
