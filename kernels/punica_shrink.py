"""LoRA shrink: the rank-sized product x @ A^T of each token with its adapter's A (Punica's shrink).

Prefill steps take the SGMV form: one program per (segment, block of its rows, block of ranks), a tl.dot over K;
decode steps the BGMV form: one program per (token, block of ranks, split of K), the splits summed with atomic adds.
Both write float32 [T, R'], zeros for base-model tokens. a_stack [S, R', K] holds every slot's A (the slices of a
fused projection stacked along R')."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_indices import LoRAIndices


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
    x_ptr, a_ptr, out_ptr, token_slots_ptr,
    K, R, K_PER_SPLIT,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    if slot >= 0:
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        k_start = tl.program_id(2) * K_PER_SPLIT
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = (ks < K) & (ks < k_start + K_PER_SPLIT)
            x = tl.load(x_ptr + token * stride_xm + ks * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :] * stride_ak,
                        mask=(ranks[:, None] < R) & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.atomic_add(out_ptr + token * stride_om + ranks * stride_or, acc, mask=ranks < R)


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
    block_m = max(16, min(64, triton.next_power_of_2(indices.max_seg_len)))
    block_k = 64 if x.dtype == torch.float32 else 128
    grid = (indices.num_segments, triton.cdiv(indices.max_seg_len, block_m), triton.cdiv(r, block_r))
    _sgmv_shrink_kernel[grid](
        x, a_stack, out, indices.seg_starts, indices.seg_slots, k, r,
        x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, PRECISION=_precision(x.dtype), num_warps=4,
    )
    return out


def bgmv_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: LoRAIndices, split_k: int | None = None
                ) -> torch.Tensor:
    """x [T, K] -> float32 [T, R']: token-wise x @ a_stack[token_slots[t]]^T, K split over programs (few tokens
    would otherwise leave most of the GPU idle)."""
    num_tokens, k = x.shape
    r = a_stack.shape[1]
    out = torch.zeros(num_tokens, r, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    block_k = 256
    if split_k is None:  # about 128 programs in all
        split_k = max(1, min(triton.cdiv(k, block_k), 128 // max(1, num_tokens * triton.cdiv(r, block_r))))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    grid = (num_tokens, triton.cdiv(r, block_r), triton.cdiv(k, k_per_split))
    _bgmv_shrink_kernel[grid](
        x, a_stack, out, indices.token_slots, k, r, k_per_split,
        x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )
    return out
