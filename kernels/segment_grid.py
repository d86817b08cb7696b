"""The rows side of the SGMV launches (kernels/punica_shrink.py, kernels/punica_expand.py): one program per segment
of LoRAIndices and block of its rows. Kept out of kernels/lora_indices.py, which CPU-only processes import: this
one needs Triton."""

from __future__ import annotations

import triton

from kernels.lora_indices import LoRAIndices


def segment_grid(indices: LoRAIndices) -> tuple[int, tuple[int, int]]:
    """(BLOCK_M, the grid's first two dimensions: segments, blocks of the longest segment's rows)."""
    block_m = max(16, min(64, triton.next_power_of_2(indices.max_seg_len)))
    return block_m, (indices.num_segments, triton.cdiv(indices.max_seg_len, block_m))
