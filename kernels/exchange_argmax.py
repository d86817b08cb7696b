"""Greedy tokens under tensor parallelism from the vocabulary shards' logits, exchanged through the peer buffers of
the fused all-reduce (kernels/all_reduce_norm.py) instead of an NCCL all-gather: two kernels, no collective.

1. One program per (row, 4096-column chunk) of this rank's logits finds the chunk's largest value and its vocabulary
   index (kernels/row_argmax.py's chunk reduction) and writes both as stamped words (kernels/stamped_words.py) into
   its own cell of every rank's buffer, its own included.
2. One program per row waits until every rank's words for the row carry the call's epoch, then picks the first index
   of the largest value, as argmax over the gathered logits would (ties to the lowest index, NaN as largest).

A call is one more exchange in the per-row sequence the fused all-reduce counts: it takes the next epoch of each of
its rows (the second kernel advances the counters) and the same cells, so every rank must make the same calls in the
same order, and the all-reduce's argument that a cell is never overwritten while read holds for it too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.all_reduce_norm import PATIENT_SPINS
from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.formats import ARGMAX_CHUNK, check_candidate_inputs
from kernels.row_argmax import chunk_best
from kernels.stamped_words import cell_start, check_exchange_call, missing_stamps, stamped


@triton.jit(do_not_specialize=["rank"])
def _send_chunk_best_kernel(
    x_ptr, V, stride_x, offset,
    buffer_ptrs, epoch_ptr, rank,
    BLOCK: tl.constexpr,
    WORDS: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    best, at = chunk_best(x_ptr, row.to(tl.int64), chunk, V, stride_x, BLOCK)
    epoch = tl.load(epoch_ptr + row) + 1  # the pick kernel stores it
    slots = tl.arange(0, 2)
    payload = tl.where(slots == 0, best.to(tl.int32, bitcast=True), (offset + at).to(tl.int32))
    words = stamped(payload, epoch)
    at_cell = cell_start(epoch, row, rank, WORDS, WORLD, MAX_ROWS) + 2 * chunk + slots
    for peer in tl.static_range(WORLD):
        peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.int64))
        tl.store(peer_buffer + at_cell, words)


@triton.jit(do_not_specialize=["rank"])
def _pick_exchanged_kernel(
    out_ptr, buffer_ptrs, epoch_ptr, error_ptr, rank, max_spins, num_chunks,
    CANDIDATES_PAD: tl.constexpr,  # power of two >= WORLD * num_chunks
    WORDS: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0)
    epoch = tl.load(epoch_ptr + row) + 1
    tl.store(epoch_ptr + row, epoch)
    j = tl.arange(0, CANDIDATES_PAD)  # sender-major, as the vocabulary is split: index order
    sender = j // num_chunks
    expected = j < WORLD * num_chunks
    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(tl.int64))
    value_words = own_buffer + cell_start(epoch, row, sender, WORDS, WORLD, MAX_ROWS) + 2 * (j % num_chunks)
    values = tl.load(value_words, mask=expected, other=0, volatile=True)
    indices = tl.load(value_words + 1, mask=expected, other=0, volatile=True)
    missing = missing_stamps(values, epoch, expected) + missing_stamps(indices, epoch, expected)
    spins = 0
    while (missing > 0) & (spins < max_spins):
        values = tl.load(value_words, mask=expected, other=0, volatile=True)
        indices = tl.load(value_words + 1, mask=expected, other=0, volatile=True)
        missing = missing_stamps(values, epoch, expected) + missing_stamps(indices, epoch, expected)
        spins += 1
    tl.atomic_add(error_ptr, 1, mask=missing > 0)
    best_values = tl.where(expected, values.to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    _, best = tl.max(best_values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.sum(tl.where(j == best, indices.to(tl.int32), 0), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def fits_cell(width: int, words: int) -> bool:
    """Whether a shard `width` ids wide sends its candidates in one cell of `words` words (two words a candidate)."""
    return 2 * triton.cdiv(width, ARGMAX_CHUNK) <= words


def _checked(x: torch.Tensor, offset: int, width: int, buffer_ptrs: torch.Tensor, epochs: torch.Tensor, rank: int,
             words: int) -> torch.Tensor:
    check_candidate_inputs(x, offset, width)
    if not fits_cell(width, words):
        raise ValueError(f"width: {width} columns make {triton.cdiv(width, ARGMAX_CHUNK)} candidates, a cell holds "
                         f"{words // 2}")
    check_exchange_call("logits", x.shape[0], buffer_ptrs, epochs, rank)
    return x if x.stride(1) == 1 else x.contiguous()


def _options(x: torch.Tensor, buffer_ptrs: torch.Tensor, epochs: torch.Tensor, words: int) -> dict:
    return dict(WORDS=words, WORLD=buffer_ptrs.numel(), MAX_ROWS=epochs.numel(), **launch_options(x))


def exchange_argmax(
    x: torch.Tensor,
    offset: int,
    width: int,
    *,
    buffer_ptrs: torch.Tensor,
    epochs: torch.Tensor,
    error: torch.Tensor,
    rank: int,
    words: int,
    max_spins: int = PATIENT_SPINS,
) -> torch.Tensor:
    """x [N, V <= width]: this rank's logits of the vocabulary ids offset .. offset + V, in a split where every rank
    holds `width` ids (the last one's past the vocabulary left out of x) -> [N] int64 on every rank: each row's
    argmax over the whole vocabulary. The buffers are the fused all-reduce's, of `words` words a cell."""
    x = _checked(x, offset, width, buffer_ptrs, epochs, rank, words)
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(width, ARGMAX_CHUNK)
    options = _options(x, buffer_ptrs, epochs, words)
    _send_chunk_best_kernel[(rows, num_chunks)](x, x.shape[1], x.stride(0), offset, buffer_ptrs, epochs, rank,
                                                BLOCK=ARGMAX_CHUNK, num_warps=8, **options)
    _pick_exchanged_kernel[(rows,)](out, buffer_ptrs, epochs, error, rank, max_spins, num_chunks,
                                    CANDIDATES_PAD=triton.next_power_of_2(buffer_ptrs.numel() * num_chunks),
                                    num_warps=1, **options)
    return out


def warm_up(x: torch.Tensor, width: int, *, buffer_ptrs: torch.Tensor, epochs: torch.Tensor, error: torch.Tensor,
            words: int) -> None:
    """Compiles and loads both kernels for logits like x of shards `width` wide, without running them (see
    kernels.all_reduce_norm.warm_up for why)."""
    if not x.is_cuda:
        return
    x = _checked(x, 0, width, buffer_ptrs, epochs, 0, words)
    num_chunks = triton.cdiv(width, ARGMAX_CHUNK)
    options = _options(x, buffer_ptrs, epochs, words)
    out = torch.empty(1, dtype=torch.int64, device=x.device)
    sender = _send_chunk_best_kernel.warmup(x, x.shape[1], x.stride(0), 0, buffer_ptrs, epochs, 0, grid=(1, 1),
                                            BLOCK=ARGMAX_CHUNK, num_warps=8, **options)
    picker = _pick_exchanged_kernel.warmup(out, buffer_ptrs, epochs, error, 0, PATIENT_SPINS, num_chunks, grid=(1,),
                                           CANDIDATES_PAD=triton.next_power_of_2(buffer_ptrs.numel() * num_chunks),
                                           num_warps=1, **options)
    for compiled in (sender, picker):
        compiled._init_handles()
