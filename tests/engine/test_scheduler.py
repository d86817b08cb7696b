"""The scheduler on its own, with a fake model step: budgets, ordering, chunking, preemption, aborts."""

from __future__ import annotations

import itertools
import random

import torch

from engine.config import SamplingParams
from engine.kv_cache import KVCacheManager
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus

BS = 16
_ids = itertools.count()


def make_seq(num_tokens: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 8) -> Sequence:
    start = next(_ids) * 1000
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{start}", 0, list(range(start, start + num_tokens)), params, priority, arrival, None,
                    torch.device("cpu"))


def make_scheduler(num_blocks: int = 256, max_num_seqs: int = 64, budget: int = 512,
                   prefix_caching: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, prefix_caching), max_num_seqs, budget)


def run_step(sched: Scheduler, batch: ScheduledBatch) -> list[Sequence]:
    """What the engine does after the model ran: advance, sample a fake token, finish at max_tokens."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert seq.num_computed_tokens + n <= seq.num_tokens
        seq.num_computed_tokens += n
        sched.kv.cache_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    return finished


def is_decode(seq: Sequence, n: int) -> bool:
    return seq.num_output_tokens > 0 and n == 1


def test_budget_and_max_num_seqs_hold_every_step() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=64, max_num_seqs=5, budget=48)
    seqs = [make_seq(rng.randint(1, 120), arrival=float(i)) for i in range(20)]
    for seq in seqs:
        sched.add(seq)
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch.seqs, "no progress while work is left"
        assert batch.num_tokens <= 48
        assert all(n > 0 for n in batch.num_new_tokens)
        assert len(batch) <= 5 and len(sched.running) <= 5
        assert len({id(s) for s in batch.seqs}) == len(batch)
        run_step(sched, batch)
        steps += 1
        assert steps < 500
    assert all(s.finished and s.num_output_tokens == 8 for s in seqs)
    assert sched.kv.num_used_blocks == 0


def test_decodes_come_before_new_prefills() -> None:
    sched = make_scheduler(budget=32)
    a, b = make_seq(10, arrival=0.0, max_tokens=50), make_seq(12, arrival=1.0, max_tokens=50)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert a.num_output_tokens == b.num_output_tokens == 1
    # a newcomer with a better priority still waits behind the running decodes for its share of the budget
    late = make_seq(100, priority=-5, arrival=2.0)
    sched.add(late)
    batch = sched.schedule()
    assert batch.seqs == [a, b, late]
    assert batch.num_new_tokens == [1, 1, 30]


def test_long_prompt_is_chunked_while_others_decode() -> None:
    for priority in (0, -1):  # also when the long prompt outranks the decoding sequences
        sched = make_scheduler(budget=16)
        d1, d2 = make_seq(5, arrival=0.0, max_tokens=100), make_seq(6, arrival=1.0, max_tokens=100)
        sched.add(d1)
        sched.add(d2)
        run_step(sched, sched.schedule())
        long = make_seq(100, priority=priority, arrival=2.0)
        sched.add(long)
        chunks = []
        while long.num_output_tokens == 0:
            batch = sched.schedule()
            assert batch.num_tokens <= 16
            got = dict(zip(map(id, batch.seqs), batch.num_new_tokens))
            assert got.get(id(d1)) == 1 and got.get(id(d2)) == 1, f"a decode was skipped (priority {priority})"
            chunks.append(got[id(long)])
            run_step(sched, batch)
        assert sum(chunks) == 100 and len(chunks) == 8
        assert all(c == 14 for c in chunks[:-1])


def test_waiting_order_is_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=2)
    s1 = make_seq(4, priority=1, arrival=0.0)
    s2 = make_seq(4, priority=0, arrival=2.0)
    s3 = make_seq(4, priority=0, arrival=1.0)
    s4 = make_seq(4, priority=2, arrival=-1.0)
    s5 = make_seq(4, priority=0, arrival=1.0)  # ties on both: first added first
    for seq in (s1, s2, s3, s4, s5):
        sched.add(seq)
    assert sched.waiting == [s3, s5, s2, s1, s4]
    assert sched.schedule().seqs == [s3, s5]
    assert sched.waiting == [s2, s1, s4]


def fill_until_preempted(sched: Scheduler) -> ScheduledBatch:
    for _ in range(100):
        batch = sched.schedule()
        if batch.preempted:
            return batch
        run_step(sched, batch)
    raise AssertionError("no preemption")


def test_preemption_picks_lowest_priority_then_latest_and_recomputes() -> None:
    # three 16-token prompts fill 3 of 4 blocks; the first decode step needs 3 more
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    a = make_seq(16, priority=0, arrival=0.0, max_tokens=4)
    low = make_seq(16, priority=1, arrival=1.0, max_tokens=4)
    c = make_seq(16, priority=0, arrival=2.0, max_tokens=4)
    for seq in (a, low, c):
        sched.add(seq)
    batch = fill_until_preempted(sched)
    assert batch.preempted == [low]
    assert low.status is SequenceStatus.WAITING and low in sched.waiting and low not in sched.running
    assert low.num_computed_tokens == 0 and low.block_ids == [] and low.num_preemptions == 1
    assert low not in batch.seqs
    assert sched.kv.num_used_blocks == sum(len(s.block_ids) for s in sched.running)

    # equal priorities: the latest arrival goes
    sched2 = make_scheduler(num_blocks=4, prefix_caching=False)
    x, y, z = (make_seq(16, arrival=float(t), max_tokens=4) for t in range(3))
    for seq in (x, y, z):
        sched2.add(seq)
    assert fill_until_preempted(sched2).preempted == [z]

    # the preempted sequence is recomputed from scratch: prompt and the token it had generated
    while low.num_computed_tokens == 0:
        batch = sched.schedule()
        if low in batch.seqs:
            assert batch.num_new_tokens[batch.seqs.index(low)] == low.num_tokens == 17
        run_step(sched, batch)
    while sched.has_work():
        run_step(sched, sched.schedule())
    assert all(s.num_output_tokens == 4 for s in (a, low, c))
    assert sched.kv.num_used_blocks == 0


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    running = make_seq(40, arrival=0.0, max_tokens=50)
    waiting = make_seq(20, arrival=1.0)
    sched.add(running)
    sched.add(waiting)
    run_step(sched, sched.schedule())
    assert running in sched.running and waiting in sched.waiting
    assert sched.kv.num_used_blocks == 3

    sched.finish(waiting)
    assert waiting not in sched.waiting and waiting.finished
    assert sched.kv.num_used_blocks == 3
    sched.finish(running)
    assert not sched.running and not sched.waiting and running.finished
    assert sched.kv.num_used_blocks == 0 and running.block_ids == []
    assert not sched.has_work() and sched.schedule().seqs == []


def test_preempting_an_already_scheduled_decode_takes_it_out_of_the_batch() -> None:
    # the low-priority decode is scheduled first; then the high-priority prefill chunk needs its block
    sched = make_scheduler(num_blocks=4, budget=16, prefix_caching=False)
    low = make_seq(8, priority=1, arrival=0.0, max_tokens=20)
    sched.add(low)
    run_step(sched, sched.schedule())
    high = make_seq(64, priority=0, arrival=1.0, max_tokens=1)
    sched.add(high)
    batch = fill_until_preempted(sched)
    assert batch.preempted == [low]
    assert batch.seqs == [high] and batch.num_new_tokens == [15]
    assert low.block_ids == [] and low.num_computed_tokens == 0 and low in sched.waiting
    assert sched.kv.num_used_blocks == len(high.block_ids) == 4
    run_step(sched, batch)
    for _ in range(100):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert batch.num_tokens <= 16
        run_step(sched, batch)
    assert high.num_output_tokens == 1 and low.num_output_tokens == 20
    assert sched.kv.num_used_blocks == 0
