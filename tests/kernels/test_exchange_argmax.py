"""The argmax exchanged through the peer buffers (kernels/exchange_argmax.py) against torch.argmax of the whole
logits: vocabularies that do not split evenly, several chunks a shard, ties across shards going to the lowest index,
NaN counting as largest, rows of -inf; the words a rank sends; epochs shared with the fused all-reduce.

As in tests/kernels/test_all_reduce_norm.py, two ranks run in turn in one process (rank 1's words put in rank 0's
buffer by hand first) and at once in two processes over shared memory on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.test_all_reduce_norm import Rank, _cells, _ranks, _stamped, _table

pytest.importorskip("triton")
from kernels.all_reduce_norm import PATIENT_SPINS, all_reduce_add_rms_norm, cell_words  # noqa: E402
from kernels.exchange_argmax import exchange_argmax  # noqa: E402

HIDDEN = 64  # the buffers' rows: a cell holds 32 words (bf16) or 64 (float32), 16 or 32 candidates


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[1, [3, vocab - 1]] = 50.0  # a tie across the first and the last shard
    x[2] = float("-inf")
    if rows > 3:
        x[3, vocab - 1] = float("nan")  # largest (the kernels take NaN for +inf, torch.argmax for NaN)
    return x


def _shard(x: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int, int]:
    """(real columns, offset, width) of a rank's shard, split as VocabParallelEmbedding splits the vocabulary."""
    width = -(-x.shape[1] // world)
    return x[:, rank * width: (rank + 1) * width], rank * width, width


def _call(ranks: list[Rank], rank: int, x: torch.Tensor, max_spins: int = PATIENT_SPINS, words: int | None = None):
    shard, offset, width = _shard(x, rank, len(ranks))
    me = ranks[rank]
    return exchange_argmax(shard, offset, width, buffer_ptrs=_table(ranks), epochs=me.epochs, error=me.error,
                           rank=rank, words=words or cell_words(HIDDEN, torch.float32)[1], max_spins=max_spins)


def _sent_words(x: torch.Tensor, rank: int, world: int, epoch: int) -> torch.Tensor:
    """The words a rank's send kernel writes for these rows: per chunk its best value's bits, then its index."""
    shard, offset, width = _shard(x, rank, world)
    candidates = reference.argmax_candidates(shard, offset, width)  # [N, C, 2] float32
    values = candidates[..., 0].masked_fill(candidates[..., 0].isnan(), float("inf"))
    words = torch.stack([values.view(torch.int32), candidates[..., 1].to(torch.int32)], dim=-1)
    return _stamped(words.reshape(x.shape[0], -1), epoch)


@pytest.mark.parametrize(("vocab", "dtype"), [(301, torch.float32), (9001, torch.bfloat16)])
def test_two_ranks_in_turn(device: torch.device, vocab: int, dtype: torch.dtype) -> None:
    max_rows, rows = 6, 4
    ranks = _ranks(2, max_rows, HIDDEN, torch.float32, device)
    for epoch in (1, 2, 3):  # both cells of every sender, then the first again
        x = _logits(rows, vocab, dtype, seed=vocab + epoch).to(device)
        sent = _sent_words(x, 1, 2, epoch).to(device)
        _cells(ranks[0], 2, max_rows)[epoch % 2, :rows, 1, : sent.shape[1]] = sent
        got0, got1 = _call(ranks, 0, x), _call(ranks, 1, x)
        want = x.float().cpu().argmax(dim=-1)
        assert torch.equal(got0.cpu(), want) and torch.equal(got1.cpu(), want)
        for me, rank in enumerate(ranks):
            assert rank.error.item() == 0
            assert rank.epochs.tolist() == [epoch] * rows + [0] * (max_rows - rows)
        cells = _cells(ranks[1], 2, max_rows)[epoch % 2, :rows, 0]
        assert torch.equal(cells[:, : sent.shape[1]].cpu(), _sent_words(x, 0, 2, epoch))  # rank 0's, as sent


def test_a_peer_that_never_answers_counts_an_error_instead_of_hanging(device: torch.device) -> None:
    ranks = _ranks(2, 2, HIDDEN, torch.float32, device)
    x = torch.randn(2, 100, device=device)
    _call(ranks, 0, x, max_spins=3)
    assert ranks[0].error.item() == 2 and ranks[0].epochs.tolist() == [1, 1]


def test_bad_inputs_are_rejected(device: torch.device) -> None:
    ranks = _ranks(2, 2, HIDDEN, torch.float32, device)
    with pytest.raises(ValueError, match="rows"):
        _call(ranks, 0, torch.randn(3, 100, device=device))
    with pytest.raises(ValueError, match="candidates"):
        _call(ranks, 0, torch.randn(2, 2 * 4096 * 4, device=device), words=4)  # 4 candidates a shard, room for 2
    with pytest.raises(ValueError, match="width"):
        exchange_argmax(torch.randn(2, 10, device=device), 0, 5, buffer_ptrs=_table(ranks), epochs=ranks[0].epochs,
                        error=ranks[0].error, rank=0, words=64)
    with pytest.raises(ValueError, match="rank"):
        exchange_argmax(torch.randn(2, 50, device=device), 100, 50, buffer_ptrs=_table(ranks), epochs=ranks[0].epochs,
                        error=ranks[0].error, rank=2, words=64)
    assert all(r.epochs.sum().item() == 0 and r.buffer.sum().item() == 0 for r in ranks)


def _rank_process(rank: int, ranks: list[Rank], x: torch.Tensor, partials: torch.Tensor, results) -> None:
    try:
        table = _table(ranks)
        tokens, sums = [], []
        for epoch in range(2):  # an all-reduce, then an argmax, on the same rows and epochs, twice
            _, summed = all_reduce_add_rms_norm(partials[rank, epoch], None, torch.ones(HIDDEN), 1e-6,
                                                buffer_ptrs=table, epochs=ranks[rank].epochs,
                                                error=ranks[rank].error, rank=rank)
            sums.append(summed.numpy().copy())
            tokens.append(_call(ranks, rank, x[epoch]).tolist())
        results.put((rank, tokens, sums, ranks[rank].error.item()))
    except Exception as e:  # reported to the test, not swallowed
        results.put((rank, repr(e), None, -1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the two-GPU engine tests instead")
def test_two_ranks_in_two_processes_share_the_all_reduces_epochs() -> None:
    import torch.multiprocessing as tmp

    rows = 3
    ranks = _ranks(2, 4, HIDDEN, torch.float32, torch.device("cpu"))
    for r in ranks:
        for t in (r.buffer, r.epochs, r.error):
            t.share_memory_()
    x = torch.stack([_logits(rows, 5000, torch.float32, seed) for seed in (1, 2)])
    partials = torch.randn(2, 2, rows, HIDDEN, generator=torch.Generator().manual_seed(4))
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(rank, ranks, x, partials, results)) for rank in range(2)]
    for p in procs:
        p.start()
    reports = sorted((results.get(timeout=240) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
    for rank, tokens, sums, errors in reports:
        assert errors == 0, f"rank {rank}: {tokens}"
        assert tokens == [x[epoch].argmax(dim=-1).tolist() for epoch in range(2)]
        for epoch in range(2):
            assert torch.equal(torch.from_numpy(sums[epoch]), partials[0, epoch] + partials[1, epoch])
    assert all(r.epochs[:rows].tolist() == [4] * rows for r in ranks)
