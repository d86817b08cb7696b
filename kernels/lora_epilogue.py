"""A batch-1 decode step's LoRA expand, done inside the base projection's GEMV (kernels/gemv.py) instead of in a
kernel of its own: each GEMV program adds B[slot] @ shrunk to its outputs before it scales, gates and stores them.
At batch 1 the expand kernels read a few hundred KB each and cost their launch and tail (about 2.5 us, four per
layer); in the GEMV the same reads ride along with the weight rows it streams anyway.

The shrink runs first, as a kernel of its own (kernels/punica_shrink.py's bgmv_shrink: split-K partial sums, with
the projection's RMSNorm weight applied but not its 1 / rms). The GEMV sums the partials of each output row's
slice and, where it fuses the norm, scales the LoRA term by the same 1 / rms as the base product."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_indices import LoRAIndices
from kernels.punica_shrink import SplitShrunk


@dataclass(frozen=True)
class LoRATerm:
    """What the base projection adds to one token's outputs: its shrunk rows and its slot's B (b_stack [S, N, R],
    slice i of the output columns slice_offsets[i]:slice_offsets[i + 1] taking ranks i*R:(i+1)*R)."""

    shrunk: SplitShrunk
    b_stack: torch.Tensor
    indices: LoRAIndices
    slice_offsets: torch.Tensor
    slice_offsets_host: list[int]
    rank: int

    def launch_args(self) -> dict:
        """The GEMV kernel's LoRA arguments."""
        p, b = self.shrunk.partials, self.b_stack
        return {"lora_s_ptr": p, "lora_b_ptr": b, "lora_slots_ptr": self.indices.token_slots,
                "lora_offsets_ptr": self.slice_offsets, "LORA_R": self.rank, "LORA_SPLITS": p.shape[0],
                "stride_ls": p.stride(0), "stride_lm": p.stride(1), "stride_bs": b.stride(0), "stride_bn": b.stride(1),
                "stride_br": b.stride(2), "LORA_SLICES": len(self.slice_offsets_host) - 1,
                "LORA_BLOCK_R": max(16, triton.next_power_of_2(self.rank)), "LORA": True}


def no_lora_args(placeholder: torch.Tensor) -> dict:
    """The GEMV kernel's LoRA arguments when it adds no LoRA term (never read)."""
    return {"lora_s_ptr": placeholder, "lora_b_ptr": placeholder, "lora_slots_ptr": placeholder,
            "lora_offsets_ptr": placeholder, "LORA_R": 1, "LORA_SPLITS": 1, "stride_ls": 0, "stride_lm": 0,
            "stride_bs": 0, "stride_bn": 0, "stride_br": 0, "LORA_SLICES": 1, "LORA_BLOCK_R": 16, "LORA": False}


@triton.jit
def lora_rows(m, rows, row_ok, s_ptr, b_ptr, slots_ptr, offsets_ptr, R, NUM_SPLITS, stride_ls, stride_lm,
              stride_bs, stride_bn, stride_br, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """Token m's LoRA term for weight rows `rows` [BLOCK_N] (float32; zeros for a base-model token): each row's slice
    of the shrunk partials, summed over the splits, dotted with the row of its slot's B."""
    slot = tl.load(slots_ptr + m).to(tl.int64)
    term = tl.zeros([BLOCK_N], tl.float32)
    if slot >= 0:
        piece = tl.zeros([BLOCK_N], tl.int32)
        for i in tl.static_range(1, NUM_SLICES):
            piece += (rows >= tl.load(offsets_ptr + i)).to(tl.int32)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        s_rows = s_ptr + m.to(tl.int64) * stride_lm + (piece[:, None] * R + ranks[None, :])
        s = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        for split in range(0, NUM_SPLITS):
            s += tl.load(s_rows + split * stride_ls, mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + rows.to(tl.int64)[:, None] * stride_bn + ranks[None, :] * stride_br,
                    mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
        term = tl.sum(b * s, axis=1)
    return term
