"""The fused all-reduce + residual add + RMSNorm against a sum of the ranks' rows and the reference add_rms_norm.

On the CPU (Triton's interpreter) programs run one after another, so a two-rank exchange runs as: rank 1's message is
put in rank 0's buffer by hand, rank 0's kernel runs (it sends its own message and finds rank 1's), then rank 1's
kernel runs (it finds rank 0's message and sends one equal to the hand-made one); and two processes run one rank
each at once over shared memory, each reaching the buffers at its own addresses. On a GPU the ranks' kernels run at
once on their own streams, eagerly and each replayed in a CUDA graph of its own; tests/engine/test_tensor_parallel_gpu.py
runs them on two GPUs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import reference
from tests.kernels.helpers import poisoned_outputs, rel_err, tolerance

pytest.importorskip("triton")
from kernels.all_reduce_norm import PATIENT_SPINS, all_reduce_add_rms_norm, exchange_bytes, warm_up  # noqa: E402


@dataclass
class Rank:
    buffer: torch.Tensor  # raw bytes
    epochs: torch.Tensor
    error: torch.Tensor


def _ranks(world: int, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> list[Rank]:
    nbytes = exchange_bytes(max_rows, world, hidden, dtype)
    return [
        Rank(torch.zeros(nbytes, dtype=torch.uint8, device=device),
             torch.zeros(max_rows, dtype=torch.int64, device=device),
             torch.zeros(1, dtype=torch.int32, device=device))
        for _ in range(world)
    ]


def _table(ranks: list[Rank]) -> torch.Tensor:
    return torch.tensor([r.buffer.data_ptr() for r in ranks], dtype=torch.int64, device=ranks[0].buffer.device)


def _call(ranks: list[Rank], rank: int, partial, residual, weight, eps=1e-6, max_spins=PATIENT_SPINS, table=None):
    me = ranks[min(rank, len(ranks) - 1)]
    return all_reduce_add_rms_norm(partial, residual, weight, eps, buffer_ptrs=_table(ranks) if table is None else table,
                                   epochs=me.epochs, error=me.error, rank=rank, max_spins=max_spins)


def _expected(partials: list[torch.Tensor], residual, weight, eps=1e-6):
    reduced = torch.stack([p.float() for p in partials]).sum(0).to(partials[0].dtype)
    return reference.add_rms_norm(reduced, residual, weight, eps)


def _cells(rank: Rank, world: int, max_rows: int) -> torch.Tensor:
    """A rank's buffer as [parity, row, sender, word] of int64 stamped words."""
    return rank.buffer.view(torch.int64).view(2, max_rows, world, -1)


def _stamped(rows: torch.Tensor, epoch: int) -> torch.Tensor:
    """The int64 words a sender's kernel writes for these rows at this epoch: 32 bits of values under the stamp."""
    return (rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (epoch << 32)


def _post(ranks: list[Rank], sender: int, receiver: int, rows: torch.Tensor, epoch: int, max_rows: int) -> None:
    """What `sender`'s kernel would write into `receiver`'s buffer at `epoch`."""
    words = _stamped(rows, epoch)
    _cells(ranks[receiver], len(ranks), max_rows)[epoch % 2, : rows.shape[0], sender, : words.shape[1]] = words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 40)])
def test_two_ranks_exchange_in_turn(device: torch.device, dtype: torch.dtype, rows: int, hidden: int) -> None:
    max_rows = 4
    ranks = _ranks(2, max_rows, hidden, dtype, device)
    gen = torch.Generator().manual_seed(rows * hidden)
    for epoch in (1, 2, 3):  # both cells of every sender, then the first again
        partials = [(torch.randn(rows, hidden, generator=gen) * 2).to(device, dtype) for _ in range(2)]
        residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        weight = torch.randn(hidden, generator=gen).to(device, dtype)
        before = [p.clone() for p in partials] + [residual.clone()]
        _post(ranks, sender=1, receiver=0, rows=partials[1], epoch=epoch, max_rows=max_rows)
        with poisoned_outputs():
            out0, summed0 = _call(ranks, 0, partials[0], residual, weight)
            out1, summed1 = _call(ranks, 1, partials[1], residual, weight)
        ref_out, ref_summed = _expected(partials, residual, weight)
        assert rel_err(summed0, ref_summed) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert rel_err(out0, ref_out) < tolerance(dtype)
        assert torch.equal(out0, out1) and torch.equal(summed0, summed1)  # every rank holds the same hidden state
        for me, rank in enumerate(ranks):
            assert rank.epochs[:rows].tolist() == [epoch] * rows and rank.epochs[rows:].tolist() == [0] * (max_rows - rows)
            cells = _cells(rank, 2, max_rows)
            words = cells[epoch % 2, :rows, 1 - me, : hidden * dtype.itemsize // 4]
            assert torch.equal(words, _stamped(partials[1 - me], epoch))  # rank 1's to rank 0 put there by hand
            assert cells[:, :, me].abs().sum().item() == 0 and cells[:, rows:].abs().sum().item() == 0
            assert cells[:, :, :, hidden * dtype.itemsize // 4:].abs().sum().item() == 0  # a cell's tail: never written
            assert rank.error.item() == 0
        assert all(torch.equal(a, b) for a, b in zip(before, partials + [residual]))


def test_rows_that_do_not_start_on_a_word(device: torch.device) -> None:
    """A bf16 view two bytes past a 32-bit boundary is read as words all the same (through a copy)."""
    ranks = _ranks(2, 2, 64, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1 + 2 * 64, generator=gen).to(device, torch.bfloat16)
    mine = base[1:].view(2, 64)
    assert mine.is_contiguous() and mine.data_ptr() % 4 == 2
    theirs = torch.randn(2, 64, generator=gen).to(device, torch.bfloat16)
    residual, weight = torch.randn(2, 64, generator=gen).to(device, torch.bfloat16), torch.ones(64, device=device,
                                                                                                dtype=torch.bfloat16)
    _post(ranks, sender=1, receiver=0, rows=theirs, epoch=1, max_rows=2)
    out, summed = _call(ranks, 0, mine, residual, weight)
    ref_out, ref_summed = _expected([mine, theirs], residual, weight)
    assert rel_err(summed, ref_summed) < 1e-2 and rel_err(out, ref_out) < tolerance(torch.bfloat16)
    assert torch.equal(_cells(ranks[1], 2, 2)[1, :, 0, :32], _stamped(mine.clone(), 1)) and ranks[0].error.item() == 0


def test_without_a_residual_the_sum_is_normed(device: torch.device) -> None:
    """The embedding's all-reduce: no residual to add, the same bits as adding zeros."""
    gen = torch.Generator().manual_seed(6)
    mine, theirs = (torch.randn(2, 64, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    weight = torch.randn(64, generator=gen).to(device, torch.bfloat16)
    results = []
    for residual in (None, torch.zeros_like(mine)):
        ranks = _ranks(2, 2, 64, torch.bfloat16, device)
        _post(ranks, sender=1, receiver=0, rows=theirs, epoch=1, max_rows=2)
        with poisoned_outputs():
            results.append(_call(ranks, 0, mine, residual, weight))
        assert ranks[0].error.item() == 0
    (out, summed), (zeros_out, zeros_summed) = results
    reduced = (mine.float() + theirs.float()).to(torch.bfloat16)
    assert torch.equal(summed, zeros_summed) and torch.equal(out, zeros_out)
    assert rel_err(summed, reduced) < 1e-2 and rel_err(out, reference.rms_norm(reduced, weight, 1e-6)) < tolerance(
        torch.bfloat16)


def test_a_peer_that_never_answers_counts_an_error_instead_of_hanging(device: torch.device) -> None:
    ranks = _ranks(2, 2, 32, torch.float32, device)
    x = torch.randn(2, 32, device=device)
    out, summed = _call(ranks, 0, x, torch.zeros_like(x), torch.ones(32, device=device), max_spins=3)
    assert ranks[0].error.item() == 2  # one failed wait per row
    assert torch.equal(_cells(ranks[1], 2, 2)[1, :, 0], _stamped(x, 1))  # its own message was still sent


def test_bad_inputs_are_rejected(device: torch.device) -> None:
    ranks = _ranks(2, 2, 32, torch.float32, device)
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="residual"):
        _call(ranks, 0, x, torch.zeros(2, 31, device=device), torch.ones(32, device=device))
    with pytest.raises(ValueError, match="weight"):
        _call(ranks, 0, x, x, torch.ones(31, device=device))
    with pytest.raises(ValueError, match="rows"):
        _call(ranks, 0, torch.randn(3, 32, device=device), torch.randn(3, 32, device=device), torch.ones(32, device=device))
    with pytest.raises(ValueError, match="rows, hidden"):
        _call(ranks, 0, x.view(2, 2, 16), x.view(2, 2, 16), torch.ones(16, device=device))
    with pytest.raises(ValueError, match="rank"):
        _call(ranks, 2, x, x, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="32-bit words"):
        odd = torch.randn(2, 31, device=device, dtype=torch.bfloat16)
        _call(ranks, 0, odd, odd, torch.ones(31, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        _call(ranks, 0, x.double(), x.double(), torch.ones(32, device=device, dtype=torch.float64))
    assert all(r.epochs.sum().item() == 0 and r.buffer.sum().item() == 0 for r in ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: both ranks' kernels at once")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_concurrent_streams_each_in_a_graph(world: int) -> None:
    """`world` ranks on one GPU, each on its own stream, waiting on each other's stamped words; each rank's call
    captured in a CUDA graph of its own, as each rank's process captures its step, and the graphs replayed on their
    streams with new inputs (each replay is a new epoch). Not one graph holding every rank: CUDA runs a graph's
    independent branches in any order, and on an H100 4 of 40 stream layouts ran one rank's branch only after another
    rank's, whose wait then ran out. The kernel is compiled first: loading a new module while a rank's kernel waits
    would stall the GPU before the other rank's kernel starts. Waits give up after seconds, not minutes, so a rank left
    waiting fails the error check instead of hanging the run."""
    device, dtype, hidden, rows = torch.device("cuda"), torch.bfloat16, 4096, 3
    ranks = _ranks(world, 8, hidden, dtype, device)
    table = _table(ranks)
    partials = [torch.empty(rows, hidden, device=device, dtype=dtype) for _ in range(world)]
    residual = torch.empty(rows, hidden, device=device, dtype=dtype)
    weight = torch.randn(hidden, device=device, dtype=dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    results: list = [None] * world

    def call(r: int) -> None:
        results[r] = _call(ranks, r, partials[r], residual, weight, table=table, max_spins=1 << 22)

    def on_each_stream(step) -> None:
        main = torch.cuda.current_stream()
        for r, s in enumerate(streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                step(r)
        for s in streams:
            main.wait_stream(s)

    def check() -> None:
        ref_out, ref_summed = _expected(partials, residual, weight)
        for out, summed in results:
            assert torch.equal(out, results[0][0]) and torch.equal(summed, results[0][1])
        assert rel_err(results[0][1], ref_summed) < 1e-2 and rel_err(results[0][0], ref_out) < 2e-2

    def refill(seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for p in partials:
            p.copy_(torch.randn(rows, hidden, device=device, generator=gen))
        residual.copy_(torch.randn(rows, hidden, device=device, generator=gen))

    refill(0)
    warm_up(partials[0], weight, buffer_ptrs=table, epochs=ranks[0].epochs, error=ranks[0].error, eps=1e-6)
    on_each_stream(call)
    torch.cuda.synchronize()
    check()
    graphs = [torch.cuda.CUDAGraph() for _ in range(world)]
    for r, s in enumerate(streams):
        with torch.cuda.graph(graphs[r], stream=s):
            call(r)
    for seed in (1, 2, 3):
        refill(seed)
        on_each_stream(lambda r: graphs[r].replay())
        torch.cuda.synchronize()
        check()
    assert all(r.error.item() == 0 for r in ranks)
    assert all(r.epochs[:rows].tolist() == [4] * rows for r in ranks)  # one eager call, three replays


def _rank_process(rank: int, ranks: list[Rank], inputs: list[torch.Tensor], results) -> None:
    """One rank in its own process: its view of the shared buffers has its own addresses, as over CUDA IPC."""
    try:
        table = _table(ranks)
        partials, residual, weight = inputs[:2], inputs[2], inputs[3]
        outs = [_call(ranks, rank, partials[rank][epoch], residual, weight, max_spins=200_000, table=table)
                for epoch in range(3)]
        # numpy, not tensors: a tensor would be shared through this process, which exits now
        results.put((rank, [(o.numpy().copy(), s.numpy().copy()) for o, s in outs], ranks[rank].error.item()))
    except Exception as e:  # reported to the test, not swallowed
        results.put((rank, repr(e), -1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the concurrent-streams test instead")
def test_two_ranks_in_two_processes_on_the_cpu() -> None:
    """Two processes exchanging through shared memory at once, each waiting on the other's words: three calls."""
    import torch.multiprocessing as tmp

    hidden, rows = 48, 2
    ranks = _ranks(2, 4, hidden, torch.float32, torch.device("cpu"))
    for r in ranks:
        for t in (r.buffer, r.epochs, r.error):
            t.share_memory_()
    gen = torch.Generator().manual_seed(3)
    partials = [torch.randn(3, rows, hidden, generator=gen) for _ in range(2)]
    residual, weight = torch.randn(rows, hidden, generator=gen), torch.randn(hidden, generator=gen)
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(rank, ranks, partials + [residual, weight], results))
             for rank in range(2)]
    for p in procs:
        p.start()
    reports = sorted((results.get(timeout=240) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
    for rank, outs, errors in reports:
        assert errors == 0, f"rank {rank}: {outs}"
    for epoch in range(3):
        want_out, want_summed = _expected([p[epoch] for p in partials], residual, weight)
        (out0, summed0), (out1, summed1) = [map(torch.from_numpy, report[1][epoch]) for report in reports]
        assert torch.equal(out0, out1) and torch.equal(summed0, summed1)
        assert rel_err(summed0, want_summed) < 1e-6 and rel_err(out0, want_out) < 1e-3
