"""Tokens sampled on the device whose values the host reads one step later (async scheduling).

With async scheduling the engine launches step N+1 before it has read step N's tokens: each sequence
sampled in step N gets PENDING_TOKEN appended to its token_ids, step N+1 takes that input token
straight from the device tensor (no host round trip), and the host fills the real value in while the
GPU runs step N+1. So scheduling, detokenizing and stop checks overlap with the forward pass instead
of leaving the GPU idle between steps."""

from __future__ import annotations

import torch

from engine.sequence import SampledToken, Sequence

PENDING_TOKEN = -1


class DeferredTokens:
    def __init__(self, token_ids: torch.Tensor, seqs: list[Sequence]) -> None:
        self.device_ids = token_ids.to(torch.int64).contiguous()  # row i is seqs[i]'s next token
        self.seqs = seqs
        self._ready: torch.cuda.Event | None = None
        if self.device_ids.is_cuda:
            # copied into pinned memory now, read after an event: waiting never blocks on later work in the stream
            self._host = torch.empty(self.device_ids.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(self.device_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self.device_ids

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    def on_host(self) -> bool:
        """Whether the values have reached the host (tolist() would not wait)."""
        return self._ready is None or self._ready.query()

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def mark_pending(self) -> None:
        """Appends PENDING_TOKEN to each sequence still running: the next step reads it from its row here."""
        for row, seq in enumerate(self.seqs):
            if not seq.finished:
                seq.token_ids.append(PENDING_TOKEN)
                seq.pending_row = row

    def read(self) -> list[SampledToken]:
        """The tokens, once the device has them, in place of their PENDING_TOKEN; sequences finished since are
        skipped."""
        sampled = []
        for seq, token in zip(self.seqs, self.tolist()):
            if seq.finished:
                continue
            drop_pending_token(seq)
            sampled.append(SampledToken(seq, token, None))
        return sampled


def drop_pending_token(seq: Sequence) -> None:
    if seq.pending_row >= 0:
        assert seq.token_ids[-1] == PENDING_TOKEN
        seq.token_ids.pop()
        seq.pending_row = -1
