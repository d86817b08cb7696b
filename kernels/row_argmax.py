"""Argmax over each row of logits (greedy decoding, and the exponential race of sampling), in two passes: programs
that each reduce one chunk of a row to its largest value and that value's first index, then one program per row
that picks among the chunks. torch.argmax reduces a row of 128k logits in one thread block (~28 us on an H200);
the chunks spread it over the SMs. Under tensor parallelism each rank's chunks of its vocabulary shard are the
candidates the ranks exchange (argmax_candidates), and one program a row picks among all of them.

Ties go to the lowest index and NaN counts as larger than any number, as in torch.argmax.

masked_argmax is the argmax of the logits after kernels.apply_token_bitmask_ (structured outputs), in the same two
passes: each chunk reads its row's mask words and skips the banned tokens, so the logits are neither written nor
read twice and the step launches one kernel fewer. A row without a mask reads none."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, wait_for_earlier_kernels
from kernels.formats import ARGMAX_CHUNK, check_candidate_inputs, check_candidates, check_masked_argmax

CHUNK = ARGMAX_CHUNK


@triton.jit
def chunk_values(x_ptr, row, cols, V, stride_x):
    """A row's values at `cols` in float32, NaN as +inf and columns past V as -inf."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("inf"), x)


@triton.jit
def best_of(x, chunk, BLOCK: tl.constexpr):
    """The largest of a chunk's values and the first column that holds it."""
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return best, chunk * BLOCK + at


@triton.jit
def chunk_best(x_ptr, row, chunk, V, stride_x, BLOCK: tl.constexpr):
    """The largest value of columns chunk * BLOCK .. + BLOCK of a row (NaN as +inf) and its first column."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    return best_of(chunk_values(x_ptr, row, cols, V, stride_x), chunk, BLOCK)


@triton.jit
def masked_chunk_best(x_ptr, row, chunk, V, stride_x, mask_of_row_ptr, words_ptr, W, BLOCK: tl.constexpr):
    """chunk_best over the tokens the row's mask allows (mask_of_row[row] is its row of words, -1 for none: every
    token allowed); bit j of word w allows token 32 * w + j, tokens past the words are banned."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(mask_of_row_ptr + row) + tl.zeros_like(cols)  # the row's mask, per column
    word = cols // 32
    words = tl.load(words_ptr + k.to(tl.int64) * W + word, mask=(k >= 0) & (cols < V) & (word < W), other=0)
    banned = (k >= 0) & (((words >> (cols % 32)) & 1) == 0)
    return best_of(tl.where(banned, float("-inf"), chunk_values(x_ptr, row, cols, V, stride_x)), chunk, BLOCK)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, values_ptr, indices_ptr, V, stride_x, num_chunks, mask_of_row_ptr, words_ptr, W,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if MASKED:
        best, at = masked_chunk_best(x_ptr, row, chunk, V, stride_x, mask_of_row_ptr, words_ptr, W, BLOCK)
    else:
        best, at = chunk_best(x_ptr, row, chunk, V, stride_x, BLOCK)
    tl.store(values_ptr + row * num_chunks + chunk, best)
    tl.store(indices_ptr + row * num_chunks + chunk, at)


@triton.jit
def _pick_chunk_kernel(
    values_ptr, indices_ptr, out_ptr, num_chunks,
    CHUNKS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < num_chunks
    values = tl.load(values_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(indices_ptr + row * num_chunks + best))


def argmax(x: torch.Tensor, *, chunk: int = CHUNK) -> torch.Tensor:
    """x [N, V] (any float dtype) -> [N] int64, the index of each row's largest value."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: logits [N, V] with V > 0 expected, got shape {tuple(x.shape)}")
    return _argmax(x, chunk, None)


def masked_argmax(x: torch.Tensor, words: torch.Tensor, mask_of_row: torch.Tensor, *, chunk: int = CHUNK
                  ) -> torch.Tensor:
    """kernels.reference.masked_argmax: x [N, V] float, words [K, W] int32, mask_of_row [N] int32 (a row of words,
    or -1) -> [N] int64; x is not written."""
    check_masked_argmax(x, words, mask_of_row)
    return _argmax(x, chunk, (words.contiguous(), mask_of_row.contiguous()))


def _argmax(x: torch.Tensor, chunk: int, masks: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, chunk)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int64, device=x.device)
    words, mask_of_row = masks if masks is not None else (indices, indices)  # not read without MASKED
    _chunk_argmax_kernel[(rows, num_chunks)](x, values, indices, vocab, x.stride(0), num_chunks, mask_of_row, words,
                                             words.shape[1] if masks is not None else 0, BLOCK=chunk,
                                             MASKED=masks is not None, num_warps=8, **launch_options(x))
    _pick_chunk_kernel[(rows,)](values, indices, out, num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
                                num_warps=1, **launch_options(x))
    return out


@triton.jit
def _candidates_kernel(
    x_ptr, out_ptr, V, stride_x, offset, num_chunks,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best, at = chunk_best(x_ptr, row, chunk, V, stride_x, BLOCK)
    pair = out_ptr + (row * num_chunks + chunk) * 2
    tl.store(pair, best)
    tl.store(pair + 1, (offset + at).to(tl.float32))


@triton.jit
def _pick_candidate_kernel(
    c_ptr, out_ptr, num_rows, num_chunks, num_candidates,
    CANDIDATES_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_earlier_kernels(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CANDIDATES_PAD)
    pairs = ((j // num_chunks) * num_rows + row) * num_chunks + j % num_chunks  # shard-major: index order
    values = tl.load(c_ptr + pairs * 2, mask=j < num_candidates, other=float("-inf"))
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    chosen = ((best // num_chunks) * num_rows + row) * num_chunks + best % num_chunks
    tl.store(out_ptr + row, tl.load(c_ptr + chosen * 2 + 1).to(tl.int64))


def argmax_candidates(x: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """kernels.reference.argmax_candidates (NaN counts as +inf, as argmax here)."""
    check_candidate_inputs(x, offset, width)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_chunks = triton.cdiv(width, CHUNK)
    out = torch.empty(x.shape[0], num_chunks, 2, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _candidates_kernel[(x.shape[0], num_chunks)](x, out, x.shape[1], x.stride(0), offset, num_chunks,
                                                     BLOCK=CHUNK, num_warps=8, **launch_options(x))
    return out


def pick_argmax_candidate(candidates: torch.Tensor) -> torch.Tensor:
    """kernels.reference.pick_argmax_candidate (NaN counts as +inf, as argmax here)."""
    check_candidates(candidates)
    shards, rows, num_chunks, _ = candidates.shape
    candidates = candidates.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=candidates.device)
    if rows:
        total = shards * num_chunks
        _pick_candidate_kernel[(rows,)](candidates, out, rows, num_chunks, total,
                                        CANDIDATES_PAD=triton.next_power_of_2(total), num_warps=1,
                                        **launch_options(candidates))
    return out
