"""Rank 0's step inputs (the greedy flag among them) reach rank 1 unchanged over gloo: in one message when they fit
beside the header (decode steps), in two when they do not, and the stop signal ends the loop."""

import numpy as np
import torch
import torch.multiprocessing as mp

from engine.batch_inputs import HostInputs
from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from engine.distributed.step_channel import _HEADER, _MESSAGE, receive_step, send_step
from engine.distributed.workers import free_port


def _host(num_tokens: int, num_seqs: int, max_blocks: int, seed: int) -> HostInputs:
    rng = np.random.default_rng(seed)
    return HostInputs(
        packed=rng.integers(-5, 1 << 40, 4 * num_tokens + 2 * num_seqs + 1, dtype=np.int64),
        block_tables=rng.integers(0, 1000, (num_seqs, max_blocks), dtype=np.int32),
        num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=num_tokens // num_seqs, max_seq_len=17 * seed,
        logits_indices=rng.integers(0, num_tokens, num_seqs).tolist(), num_previous_rows=seed % 3,
        greedy_tokens=seed % 2 == 1,
    )


STEPS = [_host(1, 1, 24, 1), _host(8, 8, 40, 2), _host(300, 3, 50, 3), _host(2, 2, 0, 4)]


def _rank(rank: int, port: int, results) -> None:
    tp = init_tensor_parallel(rank, 2, port, torch.device("cpu"))
    try:
        if rank == 0:
            for host in STEPS:
                send_step(tp, host)
            send_step(tp, None)
        else:
            received = []
            while (host := receive_step(tp)) is not None:
                received.append(host)
            results.put(received)
    finally:
        destroy_tensor_parallel(tp)


def test_steps_reach_the_other_rank_in_one_or_two_messages() -> None:
    sizes = [h.packed.size + h.block_tables.size + len(h.logits_indices) + _HEADER for h in STEPS]
    assert min(sizes) <= _MESSAGE < max(sizes)  # both ways are taken
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    received = results.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(received) == len(STEPS)
    for got, sent in zip(received, STEPS):
        assert np.array_equal(got.packed, sent.packed) and got.packed.dtype == np.int64
        assert np.array_equal(got.block_tables, sent.block_tables) and got.block_tables.dtype == np.int32
        assert got.block_tables.shape == sent.block_tables.shape
        assert (got.num_tokens, got.num_seqs, got.max_query_len, got.max_seq_len, got.logits_indices,
                got.num_previous_rows, got.greedy_tokens) == (sent.num_tokens, sent.num_seqs, sent.max_query_len,
                                                              sent.max_seq_len, sent.logits_indices,
                                                              sent.num_previous_rows, sent.greedy_tokens)
