"""LoRA shrink: the rank-sized product x @ A^T of each token with its adapter's A (Punica's shrink).

Prefill steps take the SGMV form: one program per (segment, block of its rows, block of ranks), a tl.dot over K,
writing float32 [T, R'] (zeros for base-model tokens); decode steps the BGMV form: one program per (token, block of
ranks, split of K), each split's partial sums kept for the expand to add up (SplitShrunk), with the RMSNorm before
the projection optionally fused; or, when the step's tokens share adapters, the grouped form: one program per (slot,
block of ranks, split of K) looping over its slot's tokens (LoRAIndices.sorted_rows) in blocks, so each adapter's A
is read once a step rather than once per token. Its grid depends on the pool's size only, not on which slots the
step uses (what a CUDA graph needs): a slot no token uses exits at once. It writes the BGMV form's SplitShrunk, so
either expand reads either shrink's output. a_stack [S, R', K] holds every slot's A (the slices of a fused
projection stacked along R')."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_configs import bgmv_shrink_config, grouped_shrink_config, split_layout
from kernels.lora_indices import LoRAIndices
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.segment_grid import segment_grid


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
    K, R,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < end
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if (slot >= 0) & (start + tl.program_id(1) * BLOCK_M < end):
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None] * stride_ak,
                        mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)
            acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + ranks[None, :] * stride_or, acc,
             mask=row_ok[:, None] & (ranks[None, :] < R))


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, norm_weight_ptr, out_ptr, token_slots_ptr,
    K, R, K_PER_SPLIT,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    if slot >= 0:
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        split = tl.program_id(2)
        k_start = split * K_PER_SPLIT
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = (ks < K) & (ks < k_start + K_PER_SPLIT)
            x = tl.load(x_ptr + token * stride_xm + ks * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :] * stride_ak,
                        mask=(ranks[:, None] < R) & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        out = out_ptr + split.to(tl.int64) * stride_os + token * stride_om
        tl.store(out + ranks * stride_or, acc, mask=ranks < R)
        if NORM:  # column R: this split's sum of squares, stored by the first block of ranks
            first = tl.arange(0, 1) + tl.program_id(1) == 0
            tl.store(out + (R + tl.arange(0, 1)) * stride_or, tl.sum(squares[None, :], axis=1), mask=first)


@triton.jit
def _grouped_shrink_kernel(
    x_ptr, a_ptr, norm_weight_ptr, out_ptr, sorted_rows_ptr, group_starts_ptr,
    K, R, K_PER_SPLIT,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    slot = tl.program_id(0)
    start = tl.load(group_starts_ptr + slot)
    end = tl.load(group_starts_ptr + slot + 1)
    if end > start:
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        split = tl.program_id(2)
        k_start = split * K_PER_SPLIT
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + ranks[None, :] * stride_ar
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            row_ok = pos < end
            rows = tl.load(sorted_rows_ptr + pos, mask=row_ok, other=0).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):  # K_PER_SPLIT: a multiple of BLOCK_K
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                if NORM:
                    squares += tl.sum(x * x, axis=1)
                    x = x * tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                a = tl.load(a_rows + ks[:, None] * stride_ak, mask=rank_ok[None, :] & k_ok[:, None],
                            other=0.0).to(tl.float32)
                acc += tl.dot(x, a, input_precision=PRECISION)
            out = out_ptr + split.to(tl.int64) * stride_os + rows * stride_om
            tl.store(out[:, None] + ranks[None, :] * stride_or, acc, mask=row_ok[:, None] & rank_ok[None, :])
            if NORM:  # column R: this split's sum of squares, stored by the first block of ranks
                tl.store(out + R * stride_or, squares, mask=row_ok & (pos * 0 + tl.program_id(1) == 0))


@dataclass
class SplitShrunk:
    """bgmv_shrink's output, which bgmv_expand_ reduces: partials [splits, T, R' + 1] float32, each split's share of
    x @ A^T over its range of K; with a fused norm (eps not None) column R' holds the split's sum of x^2, from which
    the expand scales the sum by rsqrt(sum x^2 / K + eps). Rows of base-model tokens are left unwritten."""

    partials: torch.Tensor
    k: int
    eps: float | None

    def rows(self) -> torch.Tensor:
        """[T, R'] as the expand uses them (for tests; garbage on base-model rows)."""
        total = self.partials.sum(0)
        shrunk = total[:, :-1]
        if self.eps is None:
            return shrunk
        return shrunk * torch.rsqrt(total[:, -1:] / self.k + self.eps)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """Launches inside run on `stream` after the current stream's work so far (nothing changes for None)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sgmv_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: LoRAIndices) -> torch.Tensor:
    """x [T, K] -> float32 [T, R']: segment-wise x @ a_stack[slot]^T."""
    num_tokens, k = x.shape
    r = a_stack.shape[1]
    out = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    block_m, rows_grid = segment_grid(indices)
    block_k = 64 if x.dtype == torch.float32 else 128
    grid = (*rows_grid, triton.cdiv(r, block_r))
    _sgmv_shrink_kernel[grid](
        x, a_stack, out, indices.seg_starts, indices.seg_slots, k, r,
        x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, PRECISION=_precision(x.dtype), num_warps=4,
    )
    return out


def bgmv_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: LoRAIndices, split_k: int | None = None,
                norm: tuple[torch.Tensor, float] | None = None, *, block_r: int | None = None,
                block_k: int | None = None, num_warps: int | None = None,
                stream: torch.cuda.Stream | None = None) -> SplitShrunk:
    """Token-wise x @ a_stack[token_slots[t]]^T (of rms_norm(x, *norm) with a norm: the base projection's fused
    one), K split over programs (few tokens would otherwise leave most of the GPU idle) whose partial sums the expand
    adds up: no zero-filled buffer, no atomics, the same sum in every run. split_k and the keywords override
    kernels/lora_configs.py's bgmv_shrink_config (None: its default). stream: the kernel runs there once the current
    stream's work so far is done (its output is allocated on the current stream, which must wait for `stream` before
    it reads it)."""
    num_tokens, k = x.shape
    r = a_stack.shape[1]
    cfg = bgmv_shrink_config(num_tokens, k, r, split_k=split_k, block_r=block_r, block_k=block_k,
                             num_warps=num_warps)
    k_per_split, num_splits = split_layout(k, cfg.split_k, cfg.block_k)
    out = torch.empty(num_splits, num_tokens, r + 1, dtype=torch.float32, device=x.device)
    shrunk = SplitShrunk(out, k, None if norm is None else float(norm[1]))
    if num_tokens == 0:
        return shrunk
    norm_weight = x if norm is None else norm[0]
    with on_stream(stream, x.device):
        _bgmv_shrink_kernel[(num_tokens, triton.cdiv(r, cfg.block_r), num_splits)](
            x, a_stack, norm_weight, out, indices.token_slots, k, r, k_per_split,
            x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, NORM=norm is not None, num_warps=cfg.num_warps,
            **launch_options(x),
        )
    return shrunk


def grouped_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: LoRAIndices, split_k: int | None = None,
                   norm: tuple[torch.Tensor, float] | None = None, *, block_m: int | None = None,
                   block_r: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                   stream: torch.cuda.Stream | None = None) -> SplitShrunk:
    """bgmv_shrink's result (the same SplitShrunk) from the grouped form: one program per (slot, block of ranks,
    split of K), each reading its slot's A once for all of the slot's tokens. The grid is fixed by the pool's size
    (a_stack's first dimension) and the shapes, whatever slots the step uses. split_k and the keywords override
    kernels/lora_configs.py's grouped_shrink_config (None: its default); stream as in bgmv_shrink."""
    num_tokens, k = x.shape
    num_slots, r = a_stack.shape[0], a_stack.shape[1]
    if indices.sorted_rows is None or indices.num_slots != num_slots:
        raise ValueError(f"grouped_shrink needs the grouped form of {num_slots} slots")
    cfg = grouped_shrink_config(num_slots, k, r, split_k=split_k, block_m=block_m, block_r=block_r,
                                block_k=block_k, num_warps=num_warps)
    k_per_split, num_splits = split_layout(k, cfg.split_k, cfg.block_k)  # K_PER_SPLIT: a multiple of BLOCK_K
    out = torch.empty(num_splits, num_tokens, r + 1, dtype=torch.float32, device=x.device)
    shrunk = SplitShrunk(out, k, None if norm is None else float(norm[1]))
    if num_tokens == 0 or num_slots == 0:
        return shrunk
    norm_weight = x if norm is None else norm[0]
    with on_stream(stream, x.device):
        _grouped_shrink_kernel[(num_slots, triton.cdiv(r, cfg.block_r), num_splits)](
            x, a_stack, norm_weight, out, indices.sorted_rows, indices.group_starts, k, r, k_per_split,
            x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, NORM=norm is not None,
            PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, **launch_options(x),
        )
    return shrunk
