"""The vocabulary-shard embedding lookup (kernels/embedding.py) against a lookup in the whole table: each shard
gives the rows of the ids it holds and zeros for the rest, so the shards' outputs add up to the whole table's rows;
odd hidden sizes, int32 and 2-D ids, a strided weight, and bad inputs."""

import pytest
import torch

import kernels
from kernels import reference

pytest.importorskip("triton")
from kernels.embedding import shard_embedding  # noqa: E402


def _shards(table: torch.Tensor, num_shards: int) -> list[tuple[torch.Tensor, int]]:
    """(rows, first id) of each shard, split as VocabParallelEmbedding splits a table: equal shards, the last one's
    tail zero-padded past the vocabulary."""
    rows = -(-table.shape[0] // num_shards)
    padded = torch.cat([table, table.new_zeros(rows * num_shards - table.shape[0], table.shape[1])])
    return [(padded[r * rows: (r + 1) * rows], r * rows) for r in range(num_shards)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "hidden", "num_shards"), [(37, 40, 1), (37, 40, 3), (101, 1500, 2)])
def test_shards_add_up_to_the_whole_table(device: torch.device, dtype: torch.dtype, vocab: int, hidden: int,
                                          num_shards: int) -> None:
    gen = torch.Generator().manual_seed(vocab + hidden)
    table = torch.randn(vocab, hidden, generator=gen).to(device, dtype)
    ids = torch.randint(0, vocab, (2, 9), generator=gen).to(device)
    ids[0, :2] = torch.tensor([0, vocab - 1])
    total = torch.zeros(2, 9, hidden, device=device, dtype=dtype)
    for rows, start in _shards(table, num_shards):
        got = shard_embedding(ids, rows, start)
        want = reference.shard_embedding(ids, rows, start)
        assert got.shape == (2, 9, hidden) and got.dtype == dtype and torch.equal(got, want)
        held = (ids >= start) & (ids < start + rows.shape[0])
        assert torch.equal(got[~held], torch.zeros_like(got[~held]))
        total += got
    assert torch.equal(total, table[ids])


def test_int32_ids_strided_weight_and_the_op(device: torch.device) -> None:
    wide = torch.randn(20, 48, device=device)
    weight = wide[:, 8:40]  # rows 48 apart
    ids = torch.tensor([3, 19, 0, 7], dtype=torch.int32, device=device)
    assert torch.equal(shard_embedding(ids, weight, 0), weight[ids.long()])
    assert torch.equal(kernels.shard_embedding(ids, weight, 5), reference.shard_embedding(ids, weight, 5))
    assert shard_embedding(ids[:0], weight, 0).shape == (0, 32)


def test_bad_inputs_are_rejected(device: torch.device) -> None:
    weight = torch.randn(10, 16, device=device)
    with pytest.raises(ValueError, match="ids must be int32 or int64"):
        shard_embedding(torch.zeros(3, device=device), weight, 0)
    with pytest.raises(ValueError, match="weight"):
        shard_embedding(torch.zeros(3, dtype=torch.long, device=device), weight[:, ::2], 0)
    with pytest.raises(ValueError, match="weight"):
        shard_embedding(torch.zeros(3, dtype=torch.long, device=device), weight[0], 0)


@pytest.mark.gpu
def test_llama3_halves_on_the_gpu() -> None:
    table = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([0, 64127, 64128, 128255, 5, 70000], device="cuda")
    total = sum(kernels.shard_embedding(ids, rows, start) for rows, start in _shards(table, 2))
    assert torch.equal(total, table[ids])
