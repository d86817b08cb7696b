"""Embedding lookup in a shard of the vocabulary: each token's row where this rank holds its id, zeros where another
rank does (the all-reduce after it brings those rows in). One kernel, launched with PDL like the rest of a decode
step, instead of the seven PyTorch kernels of shifting, masking, gathering and zeroing; with one rank the shard is the
whole table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.reference import check_embedding_inputs

BLOCK = 1024  # hidden values a program copies: 16 bytes a thread in bf16 with 4 warps


@triton.jit
def _shard_embedding_kernel(
    ids_ptr, weight_ptr, out_ptr, start, rows, H, stride_w,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < H
    # the id along the whole block: the interpreter mishandles a scalar mask
    local = tl.full([BLOCK], 0, tl.int64) + tl.load(ids_ptr + token).to(tl.int64) - start
    held = (local >= 0) & (local < rows)
    values = tl.load(weight_ptr + tl.where(held, local, 0) * stride_w + cols, mask=in_row & held, other=0.0)
    tl.store(out_ptr + token * H + cols, values, mask=in_row)


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """kernels.reference.shard_embedding."""
    check_embedding_inputs(ids, weight)
    flat = ids.reshape(-1)
    hidden = weight.shape[1]
    out = torch.empty(flat.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if flat.shape[0]:
        _shard_embedding_kernel[(flat.shape[0], triton.cdiv(hidden, BLOCK))](
            flat, weight, out, start, weight.shape[0], hidden, weight.stride(0), BLOCK=BLOCK, num_warps=4,
            **launch_options(weight),
        )
    return out.view(*ids.shape, hidden)
