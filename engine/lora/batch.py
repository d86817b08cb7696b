"""Each token's adapter slot in a step's flattened batch, from its sequences (in HostInputs' order)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from engine.sequence import Sequence


def token_slots(seqs: SequenceOf[Sequence], num_new_tokens: SequenceOf[int], slot_of: dict[int, int]) -> np.ndarray:
    """int32 [tokens]: the slot of each token's adapter, -1 for base-model tokens."""
    per_seq = np.fromiter((slot_of[s.lora.id] if s.lora is not None else -1 for s in seqs), dtype=np.int32,
                          count=len(seqs))
    return np.repeat(per_seq, np.asarray(num_new_tokens, dtype=np.int64))


def adapter_ids(seqs: SequenceOf[Sequence]) -> list[int]:
    """The distinct adapters of the sequences, in first-seen order."""
    return list(dict.fromkeys(s.lora.id for s in seqs if s.lora is not None))
