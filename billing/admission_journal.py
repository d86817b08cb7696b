"""The admission journal: a record of every admitted request, on local disk before its model runs, so that a
gateway killed at any instant (kill -9, the database down or not) leaves a usage event for each one.

Each process appends to its own JSONL segments in the ledger's spill dir (`journal-<owner>-<n>.jsonl`), under
an exclusive flock held while it lives: a `begin` line when a request is admitted (who, which model, when)
and an `end` line with the whole usage event when it is recorded. Lines are flushed to the OS as they are
written (a killed process loses none; a power cut may lose the last ones). A segment is rotated every
`segment_lines` lines and deleted once every request begun in it has its event stored (in the database or in
a spill segment). Segments whose owner's lock is free belong to a process that died: the ledger replays
them, an `end` line as its event and a `begin` without one as an `interrupted` event with what is known."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any, BinaryIO

from billing.ledger_spill import from_jsonable, jsonable

INTERRUPTED = "the gateway serving it stopped before it finished"


class AdmissionJournal:
    """Not thread-safe: the ledger serialises calls with its own lock."""

    def __init__(self, path: Path, owner: str, segment_lines: int = 1000) -> None:
        self.path = Path(path)
        self.owner = owner  # the process, as its spill segments name it (SpillDir.owner)
        self._segment_lines = segment_lines
        self._lock_file: IO[str] | None = None
        self._open: BinaryIO | None = None
        self._open_path: Path | None = None
        self._lines = 0
        self._next = 0
        self._pending: dict[Path, set[str]] = {}  # per segment: requests begun there, not yet stored
        self._segment_of: dict[str, Path] = {}

    def begin(self, request_id: str, row: dict[str, Any]) -> None:
        """`row`: what an `interrupted` event would hold (tenant_id, api_key_id, model, endpoint, created_at...)."""
        segment = self._append({"request_id": request_id, "begin": jsonable(row)})
        self._pending[segment].add(request_id)
        self._segment_of[request_id] = segment

    def end(self, row: dict[str, Any]) -> None:
        self._append({"request_id": row["request_id"], "event": jsonable(row)})

    def refused(self, request_id: str) -> None:
        """Begun, then refused before it ran: no event will follow, and a replay adds none."""
        self._append({"request_id": request_id, "refused": True})
        self.stored([request_id])

    def stored(self, request_ids: list[str]) -> None:
        """These requests' events are in the database or a spill segment: their lines are no longer needed."""
        for request_id in request_ids:
            segment = self._segment_of.pop(request_id, None)
            if segment is not None:
                self._pending[segment].discard(request_id)
        for segment in [s for s, left in self._pending.items() if not left and s != self._open_path]:
            self._drop_if_done(segment)

    def close(self) -> None:
        """The process stops: segments with requests not stored stay for the next process to replay."""
        if self._open is not None:
            self._open.close()
            self._open = None
            if self._open_path is not None:
                self._drop_if_done(self._open_path)
        if self._lock_file is not None:
            lock_path = Path(self._lock_file.name)
            self._lock_file.close()
            self._lock_file = None
            if not self._pending:
                lock_path.unlink(missing_ok=True)

    def _append(self, line: dict[str, Any]) -> Path:
        if self._lock_file is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_file = (self.path / f"journal-{self.owner}.lock").open("w")
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if self._open is None or self._lines >= self._segment_lines:
            self._rotate()
        assert self._open is not None and self._open_path is not None
        # unbuffered: one write(2) a line, in the OS's hands at once, so a killed process loses nothing
        self._open.write((json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n").encode())
        self._lines += 1
        return self._open_path

    def _rotate(self) -> None:
        previous = self._open_path
        if self._open is not None:
            self._open.close()
        self._open_path = self.path / f"journal-{self.owner}-{self._next:06d}.jsonl"
        self._next += 1
        self._open = self._open_path.open("ab", buffering=0)
        self._lines = 0
        self._pending[self._open_path] = set()
        if previous is not None:
            self._drop_if_done(previous)

    def _drop_if_done(self, segment: Path) -> None:
        """Deletes a segment none of whose requests still waits to be stored."""
        if not self._pending.get(segment):
            self._pending.pop(segment, None)
            segment.unlink(missing_ok=True)


def orphaned_journals(directory: Path, exclude: str | None = None) -> Iterator[tuple[Path, list[Path]]]:
    """(lock file, segments) of each process that died, its lock taken while the caller replays them."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for lock_path in sorted(directory.glob("journal-*.lock")):
        owner = lock_path.name[len("journal-"):-len(".lock")]
        if owner == exclude:
            continue
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            yield lock_path, sorted(directory.glob(f"journal-{owner}-*.jsonl"))


def events_of(segments: list[Path]) -> list[dict[str, Any]]:
    """The usage events a dead process's journal stands for: each request's recorded event, else an
    `interrupted` one from its begin line. A torn last line (the process died writing it) is skipped."""
    begun: dict[str, dict[str, Any]] = {}
    ended: dict[str, dict[str, Any]] = {}
    refused: set[str] = set()
    for segment in segments:
        for text in segment.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if "event" in line:
                ended[line["request_id"]] = from_jsonable(line["event"])
            elif "begin" in line:
                begun[line["request_id"]] = line["begin"]
            elif line.get("refused"):
                refused.add(line["request_id"])
    out = list(ended.values())
    for request_id, begin in begun.items():
        if request_id not in ended and request_id not in refused:
            out.append(interrupted_event(request_id, **from_jsonable(begin)))
    return out


def interrupted_event(request_id: str, *, created_at: datetime, tenant_id: int | None, api_key_id: int | None,
                      model: str, endpoint: str, end_user: str | None = None, tags: list[str] | None = None,
                      adapter: str | None = None) -> dict[str, Any]:
    """The usage event of a request whose gateway stopped before it finished: no tokens, no cost (what is known).
    A real event that arrives later replaces it (billing/ledger.py)."""
    return {"request_id": request_id, "created_at": created_at, "tenant_id": tenant_id, "api_key_id": api_key_id,
            "end_user": end_user, "tags": tags or [], "model": model, "adapter": adapter, "endpoint": endpoint,
            "route": None, "status": "interrupted", "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "cache_hit": False, "latency_s": 0.0, "ttft_s": None, "cost_usd": 0, "error": INTERRUPTED}
