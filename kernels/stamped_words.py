"""The word format and cell layout of the tensor-parallel exchange buffers (kernels/all_reduce_norm.py says how the
protocol works). A word is 64 bits: 32 bits of payload under the low 32 bits of the call's epoch, the stamp. Each
rank's buffer holds two cells per (row, sender), alternating between consecutive epochs, of WORDS words each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def check_exchange_call(what: str, rows: int, buffer_ptrs: torch.Tensor, epochs: torch.Tensor, rank: int) -> None:
    """ValueError unless the buffers hold `rows` rows (one epoch counter each) and `rank` is one of their ranks."""
    if rows > epochs.numel():
        raise ValueError(f"{what}: {rows} rows, the exchange buffers hold {epochs.numel()}")
    if not 0 <= rank < buffer_ptrs.numel():
        raise ValueError(f"rank {rank} of {buffer_ptrs.numel()} ranks")


@triton.jit
def stamped(payload, epoch):
    """int32 payloads -> int64 words with the epoch's low 32 bits above them."""
    return (epoch << 32) | payload.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def missing_stamps(words, epoch, mask):
    """How many of the words under mask do not carry this epoch's stamp."""
    late = ((words >> 32).to(tl.int32) != epoch.to(tl.int32)) & mask
    return tl.sum(late.to(tl.int32), axis=0)


@triton.jit
def cell_start(epoch, row, sender, WORDS: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr):
    """The index of the first word of sender's cell for this row at this epoch, in any rank's buffer."""
    return (((epoch % 2) * MAX_ROWS + row) * WORLD + sender) * WORDS
