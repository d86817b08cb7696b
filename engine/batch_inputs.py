"""Flattens a scheduled batch into the model's input tensors, with numpy on the host and one
host-to-device copy for all of them (the 1-D index tensors and the block tables, staged in one pinned buffer);
for a step a CUDA graph runs, into the graph's own buffer, which its first kernel unpacks.

The host half (HostInputs) is what rank 0 sends to the other tensor-parallel ranks each step. An input
token still PENDING_TOKEN on the host (async scheduling) is read on the device from the previous step's
sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.deferred_tokens import PENDING_TOKEN
from engine.models.attention_metadata import AttentionMetadata
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from kernels.formats import STEP_HEADER_WORDS


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: list[int]  # rows sampled: the last new token of each caught-up sequence (and its draft tokens)


@dataclass
class HostInputs:
    # int64: token ids, positions, slots, previous-step rows (num_tokens each), seq ends, query starts
    packed: np.ndarray
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    logits_indices: list[int]
    # length of the previous step's sampled-token tensor that PENDING inputs read from; 0 when none is pending
    num_previous_rows: int = 0
    # every rank picks the rows' argmax tokens from its vocabulary shard instead of returning gathered logits
    greedy_tokens: bool = False
    # int32 [num_tokens]: each token's LoRA adapter slot (-1: the base model); None when no token uses one
    lora_slots: np.ndarray | None = None


def packed_sections(num_tokens: int, num_seqs: int) -> list[int]:
    """Lengths of HostInputs.packed's parts: token ids, positions, slots, previous-step rows, seq ends, query
    starts (one more than the sequences)."""
    return [num_tokens] * 4 + [num_seqs, num_seqs + 1]


def _scheduled_tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens start..end of seq, where those past its token_ids are its draft tokens."""
    if end <= seq.num_tokens:
        return seq.token_ids[start:end]
    return (seq.token_ids + seq.spec_token_ids)[start:end]


def _logits_rows(last_rows: np.ndarray, num_drafts: np.ndarray) -> list[int]:
    """Each caught-up sequence's last row, preceded by one row per draft token it verifies."""
    if not num_drafts.any():
        return last_rows.tolist()
    return [row for last, k in zip(last_rows.tolist(), num_drafts.tolist()) for row in range(last - k, last + 1)]


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> BatchInputs:
    return device_inputs(host_inputs(batch, block_size), device)


def host_inputs(batch: ScheduledBatch, block_size: int, num_previous_rows: int = 0,
                greedy_tokens: bool = False) -> HostInputs:
    seqs = batch.seqs
    n = len(seqs)
    # one pass over the sequences (a decode step's host work is mostly per-sequence Python)
    per_seq = np.array([(s.num_computed_tokens, len(s.token_ids), len(s.spec_token_ids), s.pending_row,
                         len(s.block_ids)) for s in seqs], dtype=np.int64).reshape(n, 5)
    starts, seq_num_tokens, num_drafts, rows_of_seq, num_blocks = per_seq.T
    num_new = np.array(batch.num_new_tokens, dtype=np.int64)
    ends = starts + num_new
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    total = int(query_start[-1])

    tables = np.zeros((n, int(num_blocks.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < num_blocks[:, None]] = list(chain.from_iterable(s.block_ids for s in seqs))

    if total == n:  # one token per sequence: the decode case
        input_ids = np.array([s.token_ids[start] for s, start in zip(seqs, starts.tolist())], dtype=np.int64)
        positions = starts
        owner = np.arange(n)
    else:
        input_ids = np.fromiter(
            (t for s, a, b in zip(seqs, starts.tolist(), ends.tolist()) for t in _scheduled_tokens(s, a, b)),
            dtype=np.int64, count=total,
        )
        owner = np.repeat(np.arange(n), num_new)
        positions = np.arange(total, dtype=np.int64) - query_start[owner] + starts[owner]
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    previous_rows = np.full(total, -1, dtype=np.int64)
    pending = input_ids == PENDING_TOKEN
    any_pending = bool(pending.any())
    if any_pending:
        if not num_previous_rows:
            raise RuntimeError("a scheduled input token is pending but no step is in flight")
        previous_rows[pending] = rows_of_seq[owner[pending]]

    caught_up = seq_num_tokens + num_drafts == ends
    return HostInputs(
        packed=np.concatenate([input_ids, positions, slots, previous_rows, ends, query_start]),
        block_tables=tables,
        num_tokens=total,
        num_seqs=n,
        max_query_len=int(num_new.max()),
        max_seq_len=int(ends.max()),
        logits_indices=_logits_rows(query_start[1:][caught_up] - 1, num_drafts[caught_up]),
        num_previous_rows=num_previous_rows if any_pending else 0,
        greedy_tokens=greedy_tokens,
    )


def _pinned(words: np.ndarray, tables: np.ndarray, pin_memory: bool = True) -> tuple[torch.Tensor, int]:
    """int64 words, then int32 block tables from the next 16-byte boundary (as an allocation would start), in one
    pinned buffer from the caching host allocator, which keeps it until the copy out of it has run. Returns the
    buffer and where the tables start, in bytes."""
    word_bytes = np.ascontiguousarray(words, dtype=np.int64).view(np.uint8)
    tables_bytes = np.ascontiguousarray(tables, dtype=np.int32).view(np.uint8).ravel()
    split = -(-word_bytes.size // 16) * 16
    staging = torch.empty(split + tables_bytes.size, dtype=torch.uint8, pin_memory=pin_memory)
    raw = staging.numpy()
    raw[: word_bytes.size] = word_bytes
    raw[split:] = tables_bytes
    return staging, split


def _staged(host: HostInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int64, block tables int32) on the device. On CUDA both go through one pinned buffer and one
    asynchronous copy: a decode step's host work must stay shorter than its GPU step (2.5 ms at TP = 2 on H200s),
    and each pin_memory() call costs tens of microseconds."""
    packed, tables = host.packed, host.block_tables
    if device.type != "cuda":
        return torch.from_numpy(packed).to(device), torch.from_numpy(tables).to(device)
    staging, split = _pinned(packed, tables)
    on_device = staging.to(device, non_blocking=True)
    return (on_device[: packed.size * 8].view(torch.int64),
            on_device[split:].view(torch.int32).view(tables.shape))


def graph_staging(host: HostInputs, previous_ids: torch.Tensor | None, pin_memory: bool = True) -> torch.Tensor:
    """The step as a CUDA graph's first kernel reads it (kernels/step_inputs.py): a header (sequences, block-table
    width, the address of the previous step's tokens when inputs are pending), the packed sections and the block
    tables, in one pinned buffer."""
    header = np.zeros(STEP_HEADER_WORDS, dtype=np.int64)
    header[:2] = host.num_seqs, host.block_tables.shape[1]
    if host.num_previous_rows:
        if previous_ids is None or previous_ids.numel() < host.num_previous_rows:
            raise RuntimeError(f"a step reads {host.num_previous_rows} previous tokens but got "
                               f"{None if previous_ids is None else previous_ids.numel()}")
        header[2] = previous_ids.data_ptr()
    return _pinned(np.concatenate([header, host.packed]), host.block_tables, pin_memory)[0]


def device_inputs(host: HostInputs, device: torch.device, previous_ids: torch.Tensor | None = None) -> BatchInputs:
    total, n = host.num_tokens, host.num_seqs
    packed, tables_t = _staged(host, device)
    ids_t, pos_t, slots_t, rows_t, lens_t, qsl_t = packed.split(packed_sections(total, n))
    if host.num_previous_rows:
        ids_t = torch.where(rows_t >= 0, previous_ids[rows_t.clamp(min=0)], ids_t)
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t,
        seq_lens=lens_t.to(torch.int32),
        query_start_loc=qsl_t.to(torch.int32),
        max_query_len=host.max_query_len,
        max_seq_len=host.max_seq_len,
    )
    return BatchInputs(ids_t, pos_t, meta, host.logits_indices)
