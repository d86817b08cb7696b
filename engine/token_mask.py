"""Each step's token masks for the sequences that follow a grammar (structured outputs).

The runner asks for them when it samples, which is after the previous step's tokens have been read on the host
(with async scheduling too: LLMEngine.step reads them before it samples the step it has just launched), so each
matcher has consumed every token of its sequence. The masks are filled on the host by llguidance's thread pool,
while the GPU runs the step's forward pass, into one pinned buffer copied to the logits' device at once; the
sampler then bans the masked tokens of the constrained rows only (kernels.apply_token_bitmask_), so the other
rows of the step cost nothing more."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class TokenBitmask:
    """rows [K] int64: the logits rows to mask; words [K, W] int32: bit j of word w allows token 32 * w + j."""

    rows: torch.Tensor
    words: torch.Tensor


class TokenMasker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._executor = None
        # totals over the engine's life, for benchmarks: host seconds spent filling masks, steps with masks, rows
        self.seconds = 0.0
        self.steps = 0
        self.rows = 0

    def for_step(self, seqs: SequenceOf[Sequence]) -> TokenBitmask | None:
        """The masks of the rows (one per sequence, in order) whose sequence follows a grammar; None without any."""
        constrained = [(row, seq) for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not constrained:
            return None
        started = time.perf_counter()
        for _, seq in constrained:
            seq.grammar.catch_up(seq)
        num_words = constrained[0][1].grammar.mask_words
        pinned = self.device.type == "cuda"
        words = torch.empty((len(constrained), num_words), dtype=torch.int32, pin_memory=pinned)
        self._fill(words, [seq.grammar.matcher for _, seq in constrained])
        rows = torch.tensor([row for row, _ in constrained], dtype=torch.int64)
        if pinned:
            rows = rows.pin_memory()
        bitmask = TokenBitmask(rows.to(self.device, non_blocking=True), words.to(self.device, non_blocking=True))
        self.seconds += time.perf_counter() - started
        self.steps += 1
        self.rows += len(constrained)
        return bitmask

    def _fill(self, words: torch.Tensor, matchers: list) -> None:
        """Each matcher's mask into its row of words, in parallel (llguidance releases the GIL)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        row_bytes = words.shape[1] * words.element_size()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], words.data_ptr(),
                                               row_bytes, words.shape[0])
