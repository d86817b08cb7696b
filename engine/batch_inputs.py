"""Flattens a scheduled batch into the model's input tensors, with numpy on the host and one
host-to-device copy for all the 1-D index tensors (plus one for the block tables)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.models.attention_metadata import AttentionMetadata
from engine.scheduler import ScheduledBatch


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: list[int]  # rows whose hidden state is sampled: the last new token of each caught-up sequence


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> BatchInputs:
    seqs = batch.seqs
    n = len(seqs)
    num_new = np.fromiter(batch.num_new_tokens, dtype=np.int64, count=n)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
    ends = starts + num_new
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    total = int(query_start[-1])

    max_blocks = max(len(s.block_ids) for s in seqs)
    tables = np.zeros((n, max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_ids)] = s.block_ids

    if total == n:  # one token per sequence: the decode case
        input_ids = np.fromiter((s.token_ids[start] for s, start in zip(seqs, starts.tolist())), dtype=np.int64,
                                count=n)
        positions = starts
        owner = np.arange(n)
    else:
        input_ids = np.fromiter(
            (t for s, a, b in zip(seqs, starts.tolist(), ends.tolist()) for t in s.token_ids[a:b]),
            dtype=np.int64, count=total,
        )
        owner = np.repeat(np.arange(n), num_new)
        positions = np.arange(total, dtype=np.int64) - query_start[owner] + starts[owner]
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size

    packed = torch.from_numpy(np.concatenate([input_ids, positions, slots, ends, query_start]))
    tables_t = torch.from_numpy(tables)
    if device.type == "cuda":
        packed, tables_t = packed.pin_memory(), tables_t.pin_memory()
    packed = packed.to(device, non_blocking=True)
    tables_t = tables_t.to(device, non_blocking=True)
    ids_t, pos_t, slots_t, lens_t, qsl_t = packed.split([total, total, total, n, n + 1])

    caught_up = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=n) == ends
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t,
        seq_lens=lens_t.to(torch.int32),
        query_start_loc=qsl_t.to(torch.int32),
        max_query_len=int(num_new.max()),
        max_seq_len=int(ends.max()),
    )
    return BatchInputs(ids_t, pos_t, meta, (query_start[1:][caught_up] - 1).tolist())
