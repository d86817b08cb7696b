"""The device's adapter slots: for each decoder layer and projection group, one stack of every slot's A and one of
every slot's B (the layouts kernels/punica_shrink.py, punica_expand.py and punica_dense.py read), allocated once at
start. An adapter
a step needs is copied into a free slot, or into the least recently used slot that no sequence of the step needs;
its host copy stays, so an evicted adapter comes back with one host-to-device copy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.lora.adapter import LoRAAdapter
from engine.lora.targets import TARGETS, group_shapes
from engine.model_config import ModelConfig


@dataclass
class GroupStacks:
    """One projection group's adapters in one layer: a [S, slices * rank, in], b [S, out, rank], a transposed view of
    rank-major storage [S, rank, out] (the dense expand reads each slice's B of every slot as one matrix)."""

    a: torch.Tensor
    b: torch.Tensor
    slice_offsets: torch.Tensor  # [slices + 1] int32 on the device
    slice_offsets_host: list[int]
    rank: int


class LoRASlotPool:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: list[dict[str, GroupStacks]] = []
        for _ in range(cfg.num_hidden_layers):
            groups = {}
            for group, shape in group_shapes(cfg).items():
                offsets = [0, *np.cumsum(shape.slice_widths).tolist()]
                groups[group] = GroupStacks(
                    torch.zeros(max_loras, len(shape.slice_widths) * max_rank, shape.in_features, device=device,
                                dtype=dtype),
                    torch.zeros(max_loras, max_rank, offsets[-1], device=device, dtype=dtype).transpose(1, 2),
                    torch.tensor(offsets, dtype=torch.int32, device=device),
                    offsets,
                    max_rank,
                )
            self.layers.append(groups)
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for groups in self.layers for s in groups.values())

    def slot_of(self, adapter_id: int) -> int | None:
        return self._resident.get(adapter_id)

    def place(self, needed: list[int], fetch: Callable[[int], LoRAAdapter]) -> dict[int, int]:
        """Slots for the adapters of one step (by id), loading those not resident from fetch(id), their host copy.
        More than max_loras at once is a scheduling error (the scheduler admits at most max_loras adapters among
        running sequences)."""
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step needs {len(needed)} adapters, the pool has {self.max_loras} slots")
        for adapter_id in needed:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
        for adapter_id in needed:
            if adapter_id not in self._resident:
                slot = self._take_slot(needed)
                self._load(slot, fetch(adapter_id))
                self._resident[adapter_id] = slot
        return {adapter_id: self._resident[adapter_id] for adapter_id in needed}

    def _take_slot(self, needed: list[int]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(i for i in self._resident if i not in needed)
        return self._resident.pop(victim)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for groups in self.layers:
            for stacks in groups.values():
                stacks.a[slot].zero_()
                stacks.b[slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            group, index = TARGETS[module]
            stacks = self.layers[layer][group]
            rank, start = a.shape[0], stacks.slice_offsets_host[index]
            stacks.a[slot, index * stacks.rank: index * stacks.rank + rank].copy_(a, non_blocking=True)
            stacks.b[slot, start: start + b.shape[0], :rank].copy_(b, non_blocking=True)
        self.num_loads += 1
