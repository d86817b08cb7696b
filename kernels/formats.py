"""Data formats the engine and the kernels share: the staged decode step a CUDA graph unpacks, int4 weights packed
eight to an int32, the argmax candidates that tensor-parallel ranks exchange, and structured outputs' token masks."""

from __future__ import annotations

import torch

# ---- a staged decode step (engine/batch_inputs.py writes it, kernels/step_inputs.py unpacks it) ----------------

STEP_HEADER_WORDS = 4  # a staged step's sequences, block-table width, previous tokens' address (0: none), unused


def step_tables_offset(num_seqs: int, tokens_per_seq: int) -> int:
    """Where a staged step's block tables start, in int32 words: after the header and the packed int64 sections
    (token ids, positions, slots, previous-step rows, sequence ends, query starts), 16-byte aligned."""
    words = STEP_HEADER_WORDS + 4 * num_seqs * tokens_per_seq + 2 * num_seqs + 1
    return -(-words // 2) * 4


def check_step_buffers(staging: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    if staging.dtype != torch.int64 or not staging.is_contiguous():
        raise ValueError("staging: a contiguous int64 buffer expected")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens: int32 expected, the tables with rows of unit stride")


# ---- int4 weights: qweight [N, K/8] int32 ---------------------------------------------------------------------

INT4_PER_WORD = 8


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] int32 in 0..15: nibble i (bits 4i..4i+3) of word j holds column 8j + i."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_int4: [N, K] integers in 0..15 -> [N, K/8] int32."""
    n, k = values.shape
    if k % INT4_PER_WORD:
        raise ValueError(f"qweight: K={k} is not a multiple of {INT4_PER_WORD}")
    nibbles = values.to(torch.int64).reshape(n, k // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # < 2**32: the nibbles do not overlap
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- argmax candidates over vocabulary shards: [N, C, 2] float32, a chunk's largest value and its index ----------

ARGMAX_CHUNK = 4096  # columns a candidate of argmax_candidates covers


def check_candidate_inputs(x: torch.Tensor, offset: int, width: int) -> None:
    if x.dim() != 2 or not 0 <= x.shape[1] <= width:
        raise ValueError(f"argmax_candidates: x [N, V] with V <= width {width} expected, got {tuple(x.shape)}")
    if offset < 0 or offset + width >= 1 << 24:
        raise ValueError(f"argmax_candidates: indices offset..offset + width must lie in [0, 2^24) (exact in "
                         f"float32), got {offset}..{offset + width}")


def check_candidates(candidates: torch.Tensor) -> None:
    if candidates.dim() != 4 or candidates.shape[-1] != 2:
        raise ValueError(f"pick_argmax_candidate: candidates [S, N, C, 2] expected, got {tuple(candidates.shape)}")


# ---- structured outputs' token masks (engine/token_mask.py fills them, kernels/token_bitmask.py applies them) -----

def check_token_bitmask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """words [K, W] int32: bit j of word w allows token 32 * w + j in logits row rows[k]; tokens past 32 * W are
    not allowed."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(1) != 1:
        raise ValueError(f"apply_token_bitmask_: float logits [N, V] with unit column stride expected, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if words.dim() != 2 or words.dtype != torch.int32 or rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"apply_token_bitmask_: words [K, W] int32 and rows [K] int64 expected, got "
                         f"{words.dtype} {tuple(words.shape)} and {rows.dtype} {tuple(rows.shape)}")
    if words.shape[0] != rows.shape[0] or words.device != logits.device or rows.device != logits.device:
        raise ValueError("apply_token_bitmask_: one words row per row index, all on the logits' device")


def check_masked_argmax(logits: torch.Tensor, words: torch.Tensor, mask_of_row: torch.Tensor) -> None:
    """masked_argmax: logits [N, V > 0] float; words [K, W] int32 as check_token_bitmask's; mask_of_row [N] int32,
    the row of words of each logits row (-1: none). The values of mask_of_row are not checked (on the device)."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(f"masked_argmax: float logits [N, V] with V > 0 expected, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if words.dim() != 2 or words.dtype != torch.int32:
        raise ValueError(f"masked_argmax: words [K, W] int32 expected, got {words.dtype} {tuple(words.shape)}")
    if mask_of_row.dtype != torch.int32 or mask_of_row.shape != (logits.shape[0],):
        raise ValueError(f"masked_argmax: mask_of_row [{logits.shape[0]}] int32 expected, got {mask_of_row.dtype} "
                         f"{tuple(mask_of_row.shape)}")
    if words.device != logits.device or mask_of_row.device != logits.device:
        raise ValueError("masked_argmax: logits, words and mask_of_row on one device")
