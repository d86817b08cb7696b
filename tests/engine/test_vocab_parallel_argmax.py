"""vocab_parallel_argmax over two and three gloo ranks against torch.argmax of the whole logits: vocabularies that
do not split evenly (the last rank's padding columns hold huge values that must not win), several 4096-column
chunks a shard, ties across shards going to the lowest index, NaN counting as largest, rows of -inf, bf16."""

import torch
import torch.multiprocessing as mp

from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from engine.distributed.workers import free_port
from engine.models.linear import VocabParallelEmbedding, vocab_parallel_argmax


def _logits(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[1, [3, vocab - 1]] = 50.0  # a tie across the first and the last shard
    x[2, [vocab // 2 + 1, vocab - 2]] = 50.0  # a tie within the last shards
    x[3] = float("-inf")
    x[4, vocab - 1] = float("nan")
    x[4, 0] = float("inf")
    x[5, vocab - 1] = 60.0  # the last real column
    return x


CASES = [(301, torch.float32), (9001, torch.bfloat16), (20000, torch.float32)]


def _rank(rank: int, size: int, port: int, results) -> None:
    tp = init_tensor_parallel(rank, size, port, torch.device("cpu"))
    try:
        picked = []
        for vocab, dtype in CASES:
            embedding = VocabParallelEmbedding(vocab, 4, "cpu", dtype, tp)
            full = _logits(vocab, dtype)
            shard = torch.full((full.shape[0], embedding.rows), 1e4, dtype=dtype)  # padding columns: huge
            part = full[:, embedding.start: embedding.start + embedding.rows]
            shard[:, : part.shape[1]] = part
            picked.append(vocab_parallel_argmax(shard, embedding))
        # plain lists: a tensor put on the queue is fetched from this process over a socket, which fails once it
        # has exited
        results.put((rank, [p.tolist() for p in picked]))
    finally:
        destroy_tensor_parallel(tp)


def _run(size: int) -> dict[int, list[list[int]]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, size, port, results)) for rank in range(size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def test_every_rank_picks_the_argmax_of_the_whole_vocabulary() -> None:
    for size in (2, 3):
        got = _run(size)
        for i, (vocab, dtype) in enumerate(CASES):
            expected = _logits(vocab, dtype).argmax(dim=-1)
            assert expected[1] == 3 and expected[4] == vocab - 1 and expected[5] == vocab - 1
            for rank in range(size):
                assert got[rank][i] == expected.tolist(), (size, vocab, rank)
