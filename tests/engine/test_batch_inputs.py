"""host_inputs against the step's inputs written out sequence by sequence, on random batches: prefill chunks, decodes,
tokens still pending on the device and draft tokens."""

import random

import numpy as np
import pytest

from engine.batch_inputs import host_inputs, packed_sections
from engine.config import SamplingParams
from engine.deferred_tokens import PENDING_TOKEN
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

BLOCK_SIZE = 4


def _random_batch(rng: random.Random) -> tuple[ScheduledBatch, int]:
    seqs, num_new, next_block, num_previous_rows = [], [], 0, 0
    for i in range(rng.randint(1, 12)):
        seq = Sequence("r", i, [rng.randrange(1000) for _ in range(rng.randint(1, 30))], SamplingParams(), 0, 0.0,
                       None, "cpu")
        kind = rng.choice(["prefill", "decode", "pending", "drafts"])
        if kind == "prefill":
            seq.num_computed_tokens = rng.randrange(seq.num_tokens)
            n = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
        else:
            seq.token_ids += [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
            if kind == "pending":
                seq.token_ids.append(PENDING_TOKEN)
                seq.pending_row = rng.randrange(64)
                num_previous_rows = 64
            seq.num_computed_tokens = seq.num_tokens - 1
            n = 1
            if kind == "drafts":
                seq.spec_token_ids = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
                n += len(seq.spec_token_ids)
        blocks = -(-(seq.num_computed_tokens + n) // BLOCK_SIZE) + rng.randint(0, 2)
        seq.block_ids = list(range(next_block, next_block + blocks))
        rng.shuffle(seq.block_ids)
        next_block += blocks
        seqs.append(seq)
        num_new.append(n)
    return ScheduledBatch(seqs, num_new), num_previous_rows


@pytest.mark.parametrize("seed", range(40))
def test_host_inputs_equal_the_inputs_written_out_per_sequence(seed):
    rng = random.Random(seed)
    batch, num_previous_rows = _random_batch(rng)
    host = host_inputs(batch, BLOCK_SIZE, num_previous_rows)

    ids, positions, slots, previous, ends, query_starts, logits_rows = [], [], [], [], [], [0], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        tokens = seq.token_ids + seq.spec_token_ids
        for position in range(start, start + n):
            ids.append(tokens[position])
            positions.append(position)
            slots.append(seq.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            previous.append(seq.pending_row if tokens[position] == PENDING_TOKEN else -1)
        ends.append(start + n)
        query_starts.append(query_starts[-1] + n)
        if start + n == len(tokens):  # caught up: its drafts' rows, then its last token's
            logits_rows += list(range(query_starts[-1] - 1 - len(seq.spec_token_ids), query_starts[-1]))

    width = max(len(seq.block_ids) for seq in batch.seqs)
    tables = np.array([seq.block_ids + [0] * (width - len(seq.block_ids)) for seq in batch.seqs], dtype=np.int32)
    sections = np.split(host.packed, np.cumsum(packed_sections(host.num_tokens, host.num_seqs))[:-1])
    assert [s.tolist() for s in sections] == [ids, positions, slots, previous, ends, query_starts]
    assert np.array_equal(host.block_tables, tables) and host.block_tables.dtype == np.int32
    assert host.logits_indices == logits_rows
    assert (host.num_tokens, host.num_seqs) == (len(ids), len(batch.seqs))
    assert host.max_query_len == max(batch.num_new_tokens) and host.max_seq_len == max(ends)
    assert host.num_previous_rows == (num_previous_rows if PENDING_TOKEN in ids else 0)
