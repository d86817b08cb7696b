"""Which adapter each token of a flattened batch uses, in the forms the LoRA kernels read (kernels/punica_shrink.py,
kernels/punica_expand.py): per token (BGMV, decode steps: one token per sequence), per segment (SGMV, steps with
prefills: runs of consecutive tokens of one adapter) and, for decode steps whose tokens share adapters, grouped by
slot (the rows sorted by slot and where each slot's rows start: a grid over the slots then reads each adapter's
weights once a step, however many of the step's tokens use it). Slot -1 is the base model: no LoRA term."""

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
    one_token_per_seq: bool  # a decode step: the kernels take the per-token (BGMV) or the grouped form
    # the grouped form (None when not built): the rows sorted by slot, base-model rows last, and group_starts [S + 2]:
    # slot s's rows are sorted_rows[group_starts[s]:group_starts[s + 1]], the base-model rows the group after slot S-1
    sorted_rows: torch.Tensor | None = None  # [T] int32
    group_starts: torch.Tensor | None = None  # [S + 2] int32, static in shape: S is the slot pool's size
    grouped: bool = False  # a decode step takes the grouped form (needs sorted_rows and group_starts)
    dense: bool = False  # and its expands the dense form where kernels.lora_dense_expand says (kernels/punica_dense.py)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]

    @property
    def num_slots(self) -> int:
        """S, the grouped form's number of slots (its grid's first dimension)."""
        if self.group_starts is None:
            raise ValueError("these LoRA indices have no grouped form")
        return self.group_starts.shape[0] - 2


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


def group_rows(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The grouped form on the host: (int32 [T] the rows sorted by slot, stable, base-model rows last; int32 [S + 2]
    where each slot's rows start, then where the base-model rows start, then T)."""
    slots = np.asarray(token_slots, dtype=np.int32)
    if slots.size and int(slots.max()) >= num_slots:
        raise ValueError(f"token slot {int(slots.max())} is outside a pool of {num_slots} slots")
    keys = np.where(slots < 0, num_slots, slots)
    order = np.argsort(keys, kind="stable").astype(np.int32)
    counts = np.bincount(keys, minlength=num_slots + 1)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return order, starts


def lora_indices(token_slots: np.ndarray, device: torch.device, one_token_per_seq: bool,
                 num_slots: int | None = None, grouped: bool = False, dense: bool = False) -> LoRAIndices:
    """The per-token and segment forms from each token's slot (int, -1 for none): segments are the runs of equal
    slots; with grouped, also the grouped form over a pool of num_slots slots (decode steps), whose expands take the
    dense form with dense."""
    if dense and not grouped:
        raise ValueError("the dense LoRA expand runs in grouped decode steps only")
    slots = np.asarray(token_slots, dtype=np.int32)
    if slots.size:
        boundaries = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], boundaries, [slots.size]]).astype(np.int32)
    else:
        starts = np.zeros(1, dtype=np.int32)
    seg_slots = slots[starts[:-1]]
    lengths = np.diff(starts)
    parts = [slots, starts, seg_slots]
    if grouped:
        if num_slots is None:
            raise ValueError("the grouped form needs the pool's number of slots")
        parts += list(group_rows(slots, num_slots))
    packed = _to_device(np.concatenate(parts), torch.device(device)).split([p.size for p in parts])
    indices = LoRAIndices(*packed[:3], int(lengths.max(initial=0)), one_token_per_seq)
    if grouped:
        indices.sorted_rows, indices.group_starts = packed[3:]
        indices.grouped = True
        indices.dense = dense
    return indices


def _to_device(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """On CUDA through pinned memory (the caching host allocator's): a copy from pageable memory would make the host
    wait for the step in flight."""
    host = torch.from_numpy(words)
    if device.type != "cuda":
        return host.to(device)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
