"""BlockPool and KVCacheManager on their own: reference counts, refusals, prefix lookup, LRU eviction."""

from __future__ import annotations

import itertools

import pytest
import torch

import engine.kv_cache as kv_cache
from engine.config import SamplingParams
from engine.kv_cache import BlockPool, KVCacheManager, chain_hash
from engine.sequence import Sequence

BS = 16
_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"r{next(_ids)}", 0, tokens, SamplingParams(), 0, 0.0, None, torch.device("cpu"))


def block(start: int) -> list[int]:
    """One full block of distinct token ids."""
    return list(range(start, start + BS))


def compute(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Admits seq with its cached prefix, computes all its tokens and caches its full blocks.
    Returns the cached block ids it adopted."""
    cached = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - len(cached) * BS, cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return cached


def test_allocate_and_release_count_references() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 1
    assert all(pool.blocks[i].ref_count == 1 for i in ids)
    pool.take([ids[0]])
    assert pool.blocks[ids[0]].ref_count == 2
    pool.release([ids[0]])
    assert pool.blocks[ids[0]].ref_count == 1 and pool.num_free == 1
    pool.release(ids)
    assert pool.num_free == 4 and all(b.ref_count == 0 for b in pool.blocks)
    with pytest.raises(AssertionError):
        pool.release([ids[1]])


def test_full_pool_refuses_and_changes_nothing() -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    free_before = list(pool.free_queue)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert list(pool.free_queue) == free_before
    assert [pool.blocks[i].ref_count for i in held] == [1, 1]

    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make_seq(block(0) + block(100) + [7])
    compute(kv, a)
    kv.free(a)  # two cached blocks, now idle in the free queue
    b = make_seq(block(0) + block(100) + block(200) + block(300) + [9])
    cached = kv.find_cached_prefix(b)
    assert len(cached) == 2
    # 4 cached+new blocks fit only if the 2 idle cached ones are not counted twice: 5 blocks do not fit
    state = [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks]
    free_queue = list(kv.pool.free_queue)
    assert not kv.allocate(b, b.num_tokens - 2 * BS, cached)
    assert b.block_ids == []
    assert [(blk.ref_count, blk.block_hash) for blk in kv.pool.blocks] == state
    assert list(kv.pool.free_queue) == free_queue
    assert kv.find_cached_prefix(make_seq(block(0) + block(100) + [1])) == cached


def test_allocation_grows_by_whole_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(block(0))
    assert kv.allocate(seq, BS)
    assert len(seq.block_ids) == 1
    seq.num_computed_tokens = BS
    seq.token_ids.append(5)
    assert kv.allocate(seq, 1)
    assert len(seq.block_ids) == 2 and kv.num_used_blocks == 2
    seq.num_computed_tokens += 1
    seq.token_ids.append(6)
    assert kv.allocate(seq, 1)
    assert len(seq.block_ids) == 2  # room left in the second block
    kv.free(seq)
    assert kv.num_used_blocks == 0 and seq.block_ids == []


def test_prefix_hits_only_identical_prefixes() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    x, y, z = block(0), block(100), block(200)
    a = make_seq(x + y + z + [1])
    compute(kv, a)

    same = make_seq(x + y + z + [2])
    assert kv.find_cached_prefix(same) == a.block_ids[:3]
    # y and z again, but after a different first block: nothing may be found
    other_start = make_seq(block(50) + y + z + [1])
    assert kv.find_cached_prefix(other_start) == []
    # x matches, then a different block, then z again: only x
    other_middle = make_seq(x + block(150) + z + [1])
    assert kv.find_cached_prefix(other_middle) == a.block_ids[:1]
    # a block's hash depends on everything before it
    assert chain_hash(None, tuple(y)) != chain_hash(chain_hash(None, tuple(x)), tuple(y))
    # a differing single token inside a block breaks the match there
    x_changed = list(x)
    x_changed[5] += 1000
    assert kv.find_cached_prefix(make_seq(x_changed + y + [1])) == []


def test_hash_collision_is_caught_by_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: 42)
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    x, y = block(0), block(100)
    a = make_seq(x + y + [1])
    compute(kv, a)
    assert kv.pool.cached == {42: a.block_ids[0]}

    # every block hashes to 42, which names x's block: different tokens must not get it
    assert kv.find_cached_prefix(make_seq(y + x + [1])) == []
    assert kv.find_cached_prefix(make_seq(block(30) + [1])) == []
    # the identical first block is found; the second (same forged hash, other tokens) is not
    assert kv.find_cached_prefix(make_seq(x + y + [1])) == a.block_ids[:1]


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    prompt = block(0) + block(100)
    a = make_seq(prompt)
    compute(kv, a)
    kv.free(a)
    again = make_seq(list(prompt))
    cached = kv.find_cached_prefix(again)
    assert len(cached) == 1
    assert kv.allocate(again, again.num_tokens - BS, cached)
    assert len(again.block_ids) == 2
    longer = make_seq(prompt + [3])
    assert len(kv.find_cached_prefix(longer)) == 2


def test_lru_evicts_oldest_released_first_and_tails_before_prefixes() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a_prompt = block(0) + block(100) + [1]
    b_prompt = block(200) + block(300) + [1]
    a, b = make_seq(a_prompt), make_seq(b_prompt)
    compute(kv, a)
    compute(kv, b)
    assert kv.num_free_blocks == 0
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)  # released first: evicted first
    kv.free(b)
    assert kv.num_free_blocks == 6

    filler = make_seq(block(1000) + block(1100) + block(1200) + [1])
    assert kv.find_cached_prefix(filler) == []
    assert kv.allocate(filler, filler.num_tokens)  # takes 4 blocks: all of a's, then b's partial tail
    assert kv.find_cached_prefix(make_seq(list(a_prompt))) == []
    assert sorted(filler.block_ids) == sorted(a_blocks + b_blocks[2:])
    assert kv.find_cached_prefix(make_seq(list(b_prompt))) == b_blocks[:2]

    one_more = make_seq([5])
    assert kv.allocate(one_more, 1)  # evicts b's second block before its first
    remaining = kv.find_cached_prefix(make_seq(list(b_prompt)))
    assert remaining == b_blocks[:1]
    assert one_more.block_ids == [b_blocks[1]]


def test_reused_cached_block_leaves_the_free_queue() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make_seq(block(0) + [1])
    compute(kv, a)
    first = a.block_ids[0]
    kv.free(a)
    b = make_seq(block(0) + [2])
    assert compute(kv, b) == [first]
    assert first not in kv.pool.free_queue and kv.pool.blocks[first].ref_count == 1
    # the pool must never hand out a block that a running sequence holds
    c = make_seq(block(500) + [1])
    compute(kv, c)
    assert first not in c.block_ids
    assert kv.num_free_blocks == 0


def test_shared_prefix_blocks_are_counted_twice_and_stay_cached() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    x, y = block(0), block(100)
    a = make_seq(x + y + block(200) + [1])
    compute(kv, a)
    b = make_seq(x + y + block(300) + [2])
    shared = compute(kv, b)
    assert shared == a.block_ids[:2] == b.block_ids[:2]
    assert [kv.pool.blocks[i].ref_count for i in shared] == [2, 2]
    assert len(set(a.block_ids[2:]) & set(b.block_ids[2:])) == 0

    a_tail = a.block_ids[2:]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in shared] == [1, 1]
    assert all(kv.pool.blocks[i].ref_count == 0 for i in a_tail)
    c = make_seq(x + y + [3])
    assert kv.find_cached_prefix(c) == shared
    kv.free(b)
    assert kv.num_used_blocks == 0
    assert kv.find_cached_prefix(c) == shared
