"""Continuous batching under a token budget.

Each step: running sequences first (decodes, then unfinished prefill chunks, each in priority order),
then waiting ones, admitted with whatever their cached prefix saves and prefilled in chunks that
fit the remaining budget. When the KV pool runs out, the lowest-priority running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_loras: int = 0) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct adapters among running sequences: the device's adapter slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self._running_sorted = True  # running is in Sequence.sort_key order (appends may break it)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key()), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence (finished or aborted) and frees its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.grammar = None
        seq.status = SequenceStatus.FINISHED

    def _fit_draft_tokens(self, seq: Sequence, budget: int, has_room: bool) -> tuple[int, bool]:
        """A decoding sequence's draft tokens take what is left of the budget and blocks beyond one per running
        sequence, so they never cost another sequence its place; without room it decodes one token."""
        del seq.spec_token_ids[budget - 1 :]
        num_new = 1 + len(seq.spec_token_ids)
        needed = self.kv.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_ids)
        if seq.spec_token_ids and self.kv.num_free_blocks - needed >= len(self.running):
            if self.kv.allocate(seq, num_new):
                return num_new, True
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        return 1, has_room

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if not self._running_sorted:
            self.running.sort(key=Sequence.sort_key)
            self._running_sorted = True

        # decodes first, then unfinished prefill chunks, each in priority order (sorted() is stable)
        to_compute = [len(s.token_ids) - s.num_computed_tokens for s in self.running]
        order = self.running
        if any(n > 1 for n in to_compute):
            order = [s for _, s in sorted(zip(to_compute, self.running), key=lambda pair: pair[0] > 1)]
        for seq in list(order):
            if budget <= 0:
                break
            if seq.status is SequenceStatus.WAITING:
                continue  # preempted earlier in this step
            if seq.finishes_when_read:
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            has_room = num_new == 1 and seq.num_computed_tokens < len(seq.block_ids) * self.kv.block_size
            if seq.spec_token_ids:
                num_new, has_room = self._fit_draft_tokens(seq, budget, has_room)
            while not has_room and not self.kv.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim in batch.seqs:  # scheduled earlier in this step: take it back out
                    k = batch.seqs.index(victim)
                    del batch.seqs[k]
                    budget += batch.num_new_tokens.pop(k)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

        if batch.preempted:
            return batch

        adapters = {s.lora.id for s in self.running if s.lora is not None}
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.lora is not None and seq.lora.id not in adapters and len(adapters) >= self.max_loras:
                i += 1  # waits for a slot; requests for adapters already running go ahead of it
                continue
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_new, cached):
                break
            del self.waiting[i]
            if seq.lora is not None:
                adapters.add(seq.lora.id)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._running_sorted = False
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch
