"""Which adapter each token of a flattened batch uses, in the two forms the LoRA kernels read (kernels/punica_shrink.py,
kernels/punica_expand.py): per token (BGMV, decode steps: one token per sequence) and per segment (SGMV, steps with
prefills: runs of consecutive tokens of one adapter). Slot -1 is the base model: no LoRA term."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAIndices:
    token_slots: torch.Tensor  # [T] int32: each token's adapter slot, -1 for none
    seg_starts: torch.Tensor  # [G + 1] int32: segment g is rows seg_starts[g]:seg_starts[g + 1]
    seg_slots: torch.Tensor  # [G] int32: each segment's slot (consecutive segments may share one)
    max_seg_len: int  # the longest segment's rows, for the SGMV grid
    one_token_per_seq: bool  # a decode step: the kernels take the per-token (BGMV) form

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]


def check_lora_stacks(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, slice_offsets: list[int],
                      rank: int) -> None:
    """a_stack [S, slices * rank, K], b_stack [S, N, rank], slice_offsets [slices + 1] from 0 to N."""
    num_slices = len(slice_offsets) - 1
    if a_stack.dim() != 3 or a_stack.shape[1] != num_slices * rank or a_stack.shape[2] != x.shape[-1]:
        raise ValueError(f"a_stack: shape {tuple(a_stack.shape)} does not fit {num_slices} slices of rank {rank} "
                         f"over {x.shape[-1]} inputs")
    if b_stack.dim() != 3 or b_stack.shape[2] != rank or b_stack.shape[1] != slice_offsets[-1]:
        raise ValueError(f"b_stack: shape {tuple(b_stack.shape)} does not fit rank {rank} and "
                         f"{slice_offsets[-1]} outputs")


def lora_indices(token_slots: np.ndarray, device: torch.device, one_token_per_seq: bool) -> LoRAIndices:
    """Both forms from each token's slot (int, -1 for none): segments are the runs of equal slots."""
    slots = np.asarray(token_slots, dtype=np.int32)
    if slots.size:
        boundaries = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], boundaries, [slots.size]]).astype(np.int32)
    else:
        starts = np.zeros(1, dtype=np.int32)
    seg_slots = slots[starts[:-1]]
    lengths = np.diff(starts)
    packed = _to_device(np.concatenate([slots, starts, seg_slots]), torch.device(device))
    token_t, starts_t, seg_t = packed.split([slots.size, starts.size, seg_slots.size])
    return LoRAIndices(token_t, starts_t, seg_t, int(lengths.max(initial=0)), one_token_per_seq)


def _to_device(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """On CUDA through pinned memory (the caching host allocator's): a copy from pageable memory would make the host
    wait for the step in flight."""
    host = torch.from_numpy(words)
    if device.type != "cuda":
        return host.to(device)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
