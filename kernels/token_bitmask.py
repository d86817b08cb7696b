"""Structured outputs' token masks on the logits: for each constrained row, every token whose bit is 0 in the row's
packed mask (int32 words, bit j of word w is token 32 * w + j, as llguidance writes them) gets -inf, in place. One
program per (mask row, block of columns); the unconstrained rows of the step are not read or written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import check_token_bitmask

BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, words_ptr, rows_ptr, V, W, stride_logits, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = cols // 32
    words = tl.load(words_ptr + i.to(tl.int64) * W + word, mask=(cols < V) & (word < W), other=0)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=(cols < V) & banned)


def apply_token_bitmask_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [N, V] (float, unit column stride), words [K, W] int32, rows [K] int64 distinct indices into N."""
    check_token_bitmask(logits, words, rows)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, words.contiguous(), rows, vocab, words.shape[1], logits.stride(0),
                                      BLOCK=BLOCK)
