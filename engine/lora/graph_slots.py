"""The adapter slot of each token of a decode step that replays a CUDA graph: the graph's LoRA kernels were captured
reading static device buffers, which are filled before each replay (-1, no adapter, on the graph's padding rows).
The adapters' weights need nothing of the kind: they stay in the slot pool's stacks, which loading an adapter copies
into, so a graph always reads the weights of the adapters in the slots now.

The buffers hold both layouts of the LoRA kernels' indices: each token's slot (per-token BGMV kernels, and the dense
expand's rows) and the rows sorted by slot with where each slot's rows start (grouped kernels, whose grid spans the
whole pool and so has the same shape whichever slots a step uses). A step takes one decode form, "bgmv", "grouped" or
"dense" (engine/lora/batch.py decode_form); a graph is captured with one form's kernels in it, so the decode graphs
with LoRA keep one graph per (shape, form) and a step replays the one of its form. Both layouts are staged at every
step, in one copy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from engine.lora.batch import decode_form
from engine.lora.projection import LoRAStep
from kernels.lora_indices import LoRAIndices, group_rows


class GraphLoRASlots:
    def __init__(self, step: LoRAStep, max_tokens: int, device: torch.device, num_slots: int,
                 kernels: str = "auto") -> None:
        self.step = step
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self.kernels = kernels  # EngineConfig.lora_decode_kernels
        # one buffer, one copy a step: token slots [max_tokens], sorted rows [max_tokens], group starts [S + 2]
        self.words = torch.full((2 * max_tokens + num_slots + 2,), -1, dtype=torch.int32, device=device)
        self.token_slots = self.words[:max_tokens]
        self.sorted_rows = self.words[max_tokens: 2 * max_tokens]
        self.group_starts = self.words[2 * max_tokens:]
        self.seg_starts = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)

    def form(self, slots: np.ndarray | None) -> str:
        """The decode form of the graph a step with these token slots replays."""
        return decode_form(slots, self.kernels, self.num_slots)

    def indices(self, num_tokens: int, form: str = "bgmv") -> LoRAIndices:
        """The first num_tokens rows, each token its own segment (the decode kernels read only token_slots, or in
        the grouped and dense forms also the sorted rows and group starts)."""
        slots = self.token_slots[:num_tokens]
        return LoRAIndices(slots, self.seg_starts[: num_tokens + 1], slots, 1, one_token_per_seq=True,
                           sorted_rows=self.sorted_rows[:num_tokens], group_starts=self.group_starts,
                           grouped=form != "bgmv", dense=form == "dense")

    @contextlib.contextmanager
    def applied(self, num_tokens: int, form: str = "bgmv") -> Iterator[None]:
        """The model's LoRA projections read these buffers while a graph of num_tokens rows is captured."""
        self.step.indices = self.indices(num_tokens, form)
        try:
            yield
        finally:
            self.step.indices = None

    def stage(self, slots: np.ndarray | None, num_tokens: int) -> None:
        """Copies a step's token slots into the graph's buffer, -1 past them, and its rows grouped by slot over the
        graph's num_tokens rows (padding rows with the base-model ones), without waiting."""
        n = 0 if slots is None else len(slots)
        if n > num_tokens:
            raise RuntimeError(f"a step of {n} tokens staged into a graph of {num_tokens} rows")
        staged = torch.empty(self.words.shape, dtype=torch.int32, pin_memory=self.words.is_cuda)
        words = staged.numpy()
        token_slots = words[: self.max_tokens]
        token_slots[:] = -1
        if n:
            token_slots[:n] = slots
        order, starts = group_rows(token_slots[:num_tokens], self.num_slots)
        words[self.max_tokens: self.max_tokens + num_tokens] = order
        words[self.max_tokens + num_tokens: 2 * self.max_tokens] = 0
        words[2 * self.max_tokens:] = starts
        self.words.copy_(staged, non_blocking=True)
