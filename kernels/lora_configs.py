"""Launch configurations of the LoRA decode kernels (kernels/punica_shrink.py, kernels/punica_expand.py): the
per-token (BGMV) and grouped (per-slot) shrinks and expands, and the expands with the SiLU product fused. Each rule
below resolves a launcher's configuration from its shape and from keyword overrides (None: the default); every
launcher takes the same keywords, which is how `python -m bench.lora_kernels` sweeps them. The defaults are the
ones the kernels shipped with; change them here, from that sweep's results.

A shrink's split of K: split_k is the number of splits asked for; each split covers a multiple of BLOCK_K, so the
number the kernel runs (split_layout) may be smaller, and the expand adds up that many partial sums per row."""

from __future__ import annotations

from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class ShrinkConfig:
    split_k: int  # splits of K asked for (split_layout: the number run)
    block_r: int  # ranks a program computes (of the fused projection's R' = slices * rank)
    block_k: int  # inputs a program reads per step of its loop over its split
    num_warps: int
    block_m: int = 0  # grouped form: rows (the slot's tokens) per tl.dot; 0 in the per-token form


@dataclass(frozen=True)
class ExpandConfig:
    block_n: int  # output columns a program writes
    num_warps: int
    block_m: int = 0  # grouped form: rows per tl.dot; 0 in the per-token form


def rank_block(r: int) -> int:
    """The default block of ranks of a shrink over R' ranks: all of them up to 64 (at least 16, a tl.dot's minimum)."""
    return max(16, min(64, _next_power_of_2(r)))


def expand_rank_block(rank: int) -> int:
    """An expand's block of ranks: one adapter's whole rank (not a tuning knob: it is the dot's inner dimension)."""
    return max(16, _next_power_of_2(rank))


def split_layout(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K_PER_SPLIT, the number of splits run) for split_k splits asked for: each a multiple of block_k."""
    k_per_split = _cdiv(_cdiv(k, split_k), block_k) * block_k
    return k_per_split, _cdiv(k, k_per_split)


BGMV_PROGRAMS = 128  # the per-token shrink's default split aims at about this many programs
GROUPED_PROGRAMS = 128  # and the grouped one's, over the slot pool
GROUPED_MAX_SPLITS = 32  # the grouped expand adds up every split's partial sums once per block of its columns
# the inputs one split of a shrink covers by default: the sweep's best shrink + expand pairs on the H200 split K into
# 512s at batch 1 (BGMV) and at 64 tokens over 16 adapters (grouped), docs/benchmarks/lora.md, 2026-12-03
K_PER_SPLIT = 512


def bgmv_shrink_config(num_tokens: int, k: int, r: int, *, split_k: int | None = None, block_r: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None) -> ShrinkConfig:
    """Per-token shrink of num_tokens rows of K inputs onto R' ranks."""
    block_r = block_r or 16
    block_k = block_k or 256
    if split_k is None:  # K in K_PER_SPLIT pieces, within about BGMV_PROGRAMS programs in all
        split_k = max(1, min(_cdiv(k, K_PER_SPLIT), BGMV_PROGRAMS // max(1, num_tokens * _cdiv(r, block_r))))
    return ShrinkConfig(split_k, block_r, block_k, num_warps or 8)


def grouped_shrink_config(num_slots: int, k: int, r: int, *, split_k: int | None = None, block_m: int | None = None,
                          block_r: int | None = None, block_k: int | None = None,
                          num_warps: int | None = None) -> ShrinkConfig:
    """Grouped shrink over a pool of num_slots slots, K inputs onto R' ranks."""
    block_r = block_r or 16
    block_k = block_k or 128
    if split_k is None:  # K in K_PER_SPLIT pieces, at most GROUPED_MAX_SPLITS
        split_k = max(1, min(_cdiv(k, K_PER_SPLIT), GROUPED_MAX_SPLITS))
    return ShrinkConfig(split_k, block_r, block_k, num_warps or 4, block_m or 16)


def bgmv_expand_config(n: int, rank: int, *, block_n: int | None = None,
                       num_warps: int | None = None) -> ExpandConfig:
    """Per-token expand onto a projection of n output columns (the widest slice's)."""
    return ExpandConfig(block_n or 64, num_warps or 4)


def bgmv_expand_silu_config(n: int, rank: int, *, block_n: int | None = None,
                            num_warps: int | None = None) -> ExpandConfig:
    """Per-token expand of gate|up with the SiLU product, n columns per half."""
    return ExpandConfig(block_n or 256, num_warps or 4)


def grouped_expand_config(n: int, rank: int, *, block_m: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None) -> ExpandConfig:
    """Grouped expand onto a projection of n output columns (the widest slice's)."""
    return ExpandConfig(block_n or 256, num_warps or 4, block_m or 16)


def grouped_expand_silu_config(n: int, rank: int, *, block_m: int | None = None, block_n: int | None = None,
                               num_warps: int | None = None) -> ExpandConfig:
    """Grouped expand of gate|up with the SiLU product, n columns per half."""
    return ExpandConfig(block_n or 128, num_warps or 4, block_m or 16)
