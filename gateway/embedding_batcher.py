"""Concurrent embedding requests share forward passes: requests queue their inputs, and each pass takes the
inputs queued when it starts, oldest first, up to `max_batch_size` (a request with more inputs spans passes).
Inputs that arrive while a pass runs go together in the next one. Each pass's time is split among the
tenants in it by their tokens, as engine steps are (the replica's interval rows bill GPU time from it)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Forward = Callable[[list[list[int]]], np.ndarray]  # token-id rows -> float32 [rows, dimension]


@dataclass
class _Job:
    rows: list[list[int]]
    account: str | None
    out: np.ndarray
    done: asyncio.Future[np.ndarray]
    next_row: int = 0  # the first row no pass has taken yet
    left: int = field(init=False)  # rows not computed yet

    def __post_init__(self) -> None:
        self.left = len(self.rows)


@dataclass
class BatchStats:
    passes: int = 0
    rows: int = 0
    largest_pass: int = 0
    busy_s: float = 0.0
    busy_s_by_account: dict[str | None, float] = field(default_factory=dict)


class EmbeddingBatcher:
    def __init__(self, forward: Forward, dimension: int, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: >= 1 expected, got {max_batch_size}")
        self._forward = forward
        self._dimension = dimension
        self.max_batch_size = max_batch_size
        self._queue: deque[_Job] = deque()
        self._worker: asyncio.Task[None] | None = None
        self.stats = BatchStats()

    async def embed(self, rows: list[list[int]], account: str | None = None) -> np.ndarray:
        """Embeddings of `rows` (float32 [len(rows), dimension]), computed in passes shared with other requests.
        Cancelled before its rows were taken, a request leaves the queue without being computed."""
        loop = asyncio.get_running_loop()
        job = _Job(rows, account, np.empty((len(rows), self._dimension), dtype=np.float32), loop.create_future())
        self._queue.append(job)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run())
        return await job.done

    async def _run(self) -> None:
        while self._queue:
            batch = self._take()
            if not batch:
                continue
            started = time.perf_counter()
            rows = [r for job, start, stop in batch for r in job.rows[start:stop]]
            try:
                vectors = await asyncio.to_thread(self._forward, rows)
                if vectors.shape != (len(rows), self._dimension):
                    raise RuntimeError(f"the model returned {vectors.shape} for {len(rows)} inputs")
            except Exception as e:  # every request in the pass fails with it; the queue goes on
                for job, _, _ in batch:
                    if not job.done.done():
                        job.done.set_exception(e)
                continue
            self._account(batch, time.perf_counter() - started)
            offset = 0
            for job, start, stop in batch:
                job.out[start:stop] = vectors[offset:offset + stop - start]
                offset += stop - start
                job.left -= stop - start
                if job.left == 0 and not job.done.done():
                    job.done.set_result(job.out)

    def _take(self) -> list[tuple[_Job, int, int]]:
        """The next pass: (job, first row, end row) slices of the oldest jobs, at most max_batch_size rows."""
        batch: list[tuple[_Job, int, int]] = []
        room = self.max_batch_size
        while self._queue and room:
            job = self._queue[0]
            if job.done.done():  # cancelled (or failed in an earlier pass): its other rows are not needed
                self._queue.popleft()
                continue
            stop = min(len(job.rows), job.next_row + room)
            batch.append((job, job.next_row, stop))
            room -= stop - job.next_row
            job.next_row = stop
            if stop == len(job.rows):
                self._queue.popleft()
        return batch

    def _account(self, batch: list[tuple[_Job, int, int]], elapsed: float) -> None:
        s = self.stats
        rows = sum(stop - start for _, start, stop in batch)
        s.passes += 1
        s.rows += rows
        s.largest_pass = max(s.largest_pass, rows)
        s.busy_s += elapsed
        tokens = {id(job): sum(len(r) for r in job.rows[start:stop]) for job, start, stop in batch}
        total = sum(tokens.values()) or 1
        for job, _, _ in batch:
            share = elapsed * tokens[id(job)] / total
            s.busy_s_by_account[job.account] = s.busy_s_by_account.get(job.account, 0.0) + share
