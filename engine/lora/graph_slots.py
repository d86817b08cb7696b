"""The adapter slot of each token of a decode step that replays a CUDA graph: the graph's LoRA kernels were captured
reading one static device buffer, which is filled before each replay (-1, no adapter, on the graph's padding rows).
The adapters' weights need nothing of the kind: they stay in the slot pool's stacks, which loading an adapter copies
into, so a graph always reads the weights of the adapters in the slots now."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from engine.lora.projection import LoRAStep
from kernels.lora_indices import LoRAIndices


class GraphLoRASlots:
    def __init__(self, step: LoRAStep, max_tokens: int, device: torch.device) -> None:
        self.step = step
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.seg_starts = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)

    def indices(self, num_tokens: int) -> LoRAIndices:
        """The first num_tokens rows, each token its own segment (the decode kernels read only token_slots)."""
        slots = self.token_slots[:num_tokens]
        return LoRAIndices(slots, self.seg_starts[: num_tokens + 1], slots, 1, one_token_per_seq=True)

    @contextlib.contextmanager
    def applied(self, num_tokens: int) -> Iterator[None]:
        """The model's LoRA projections read these buffers while a graph of num_tokens rows is captured."""
        self.step.indices = self.indices(num_tokens)
        try:
            yield
        finally:
            self.step.indices = None

    def stage(self, slots: np.ndarray | None, num_tokens: int) -> None:
        """Copies a step's token slots into the graph's buffer, -1 past them up to num_tokens, without waiting."""
        staged = torch.empty(num_tokens, dtype=torch.int32, pin_memory=self.token_slots.is_cuda)
        rows = staged.numpy()
        n = 0 if slots is None else len(slots)
        if n > num_tokens:
            raise RuntimeError(f"a step of {n} tokens staged into a graph of {num_tokens} rows")
        if n:
            rows[:n] = slots
        rows[n:] = -1
        self.token_slots[:num_tokens].copy_(staged, non_blocking=True)
