"""What every proposer gives: up to k guessed next tokens per sequence, with the draft distribution they were
drawn from when they were drawn at random."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.model_config import ModelConfig
from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int] = field(default_factory=list)  # may be shorter than asked, or empty
    # [len(token_ids), V]: the distribution each token was sampled from; None when the proposal is deterministic
    draft_probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[Proposal]:
        """One proposal per sequence, of at most num_tokens[i] tokens to follow seqs[i].token_ids."""
        ...

    def check_target(self, target_config: ModelConfig, max_model_len: int) -> None:
        """ValueError naming speculative_config.<field> when the proposer cannot serve this target."""
        ...

    def release(self, keep: SequenceOf[Sequence]) -> None:
        """Drops whatever the proposer holds for sequences not in keep."""
        ...
