"""N-gram prompt lookup: find the sequence's last n tokens earlier in its own prompt and output, and propose the
tokens that followed them there. Free to run, and right whenever the answer copies its input (edits,
extraction, summaries, code changes)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.model_config import ModelConfig
from engine.sequence import Sequence
from engine.spec_decode.proposer import Proposal


def lookup(token_ids: SequenceOf[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix (max_n down to min_n
    tokens). Of the occurrences, the latest one followed by k whole tokens wins, else the earliest one."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows that start at i and end before the last token, so at least one token follows them
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts) == 0:
            continue
        whole = starts[starts + n + k <= length]
        start = int(whole[-1] if len(whole) else starts[0])
        return tokens[start + n : start + n + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: SequenceOf[Sequence], num_tokens: SequenceOf[int]) -> list[Proposal]:
        return [Proposal(lookup(seq.token_ids, self.min_n, self.max_n, k)) for seq, k in zip(seqs, num_tokens)]

    def check_target(self, target_config: ModelConfig, max_model_len: int) -> None:
        pass

    def release(self, keep: SequenceOf[Sequence]) -> None:
        pass
