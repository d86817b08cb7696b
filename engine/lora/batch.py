"""Each token's adapter slot in a step's flattened batch, from its sequences (in HostInputs' order), and which form
of the LoRA kernels a decode step takes."""

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


# "auto" groups a decode step's tokens by slot when they average at least this many per distinct adapter: the
# grouped kernels then read each adapter's weights once where the per-token ones read them once per token
GROUPED_MIN_TOKENS_PER_ADAPTER = 2
# and takes the dense expand (kernels/punica_dense.py, which reads every slot's B) when the step's adapters fill at
# least this share of the pool's slots
DENSE_MIN_SLOTS_USED = 0.75


def decode_form(slots: np.ndarray | None, kernels: str, num_slots: int) -> str:
    """The LoRA kernels of a decode step with these token slots (-1: base model) over a pool of num_slots, under
    EngineConfig.lora_decode_kernels: "bgmv" (per token), "grouped" (tokens grouped by slot) or "dense" (grouped
    shrinks, dense expands); "auto" decides by tokens per distinct adapter (batch 1: per token) and by the share of
    the pool's slots in use."""
    if slots is None or kernels == "bgmv":
        return "bgmv"
    if kernels != "auto":
        return kernels
    used = slots[slots >= 0]
    distinct = np.unique(used).size
    if used.size < GROUPED_MIN_TOKENS_PER_ADAPTER * max(1, distinct):
        return "bgmv"
    return "dense" if distinct >= DENSE_MIN_SLOTS_USED * num_slots else "grouped"
