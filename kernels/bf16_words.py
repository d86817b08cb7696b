"""bf16 activations read four to a 64-bit word, for the integer-weight decode GEMVs (kernels/gemv_int.py,
kernels/gemv_int4.py): one load brings four values, and a bf16 is the high half of a float32, so each is one shift
or mask away from it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bf16_quad(words):
    """int64 words of four bf16 (lowest first) -> the four values as float32."""
    lo = words.to(tl.int32)
    hi = (words >> 32).to(tl.int32)
    return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
            (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))


def bf16_words(x: torch.Tensor, k: int, op: str) -> torch.Tensor:
    """bf16 rows x [..., K] as [M, K/4] int64 words of four values (copied when not contiguous and 8-byte aligned)."""
    if x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"{op}: bf16 rows of {k} values expected, got {x.dtype} of shape {tuple(x.shape)}")
    if k % 4:
        raise ValueError(f"{op}: K = {k} is not a multiple of 4")
    rows = x.reshape(-1, k)
    if not rows.is_contiguous() or rows.data_ptr() % 8:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.int64)
