"""Usage events that could not reach the database, kept on local disk until it is back.

Each process appends to its own JSONL segment files (`usage-<owner>-<n>.jsonl`) and holds an
exclusive flock on `usage-<owner>.lock` from its first segment on. Segments whose lock nobody holds
belong to a process that died: any later process claims them by taking that lock, replays them,
and deletes them. Replaying is safe twice over: the ledger's insert skips request ids already stored.

Events the database refuses for their data (never for being away) go to `dead-letter.jsonl` in the
same directory, each with the database's reason in `_error`; nothing replays them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

from billing.money import dollars

SEGMENT_GLOB = "usage-*.jsonl"
SEQ_FIELD = "_seq"  # the writing process's sequence number, so that it can tell which of its events are stored
DEAD_LETTER_FILE = "dead-letter.jsonl"
ERROR_FIELD = "_error"


def spill_dir_for(root: Path, db_url: str) -> Path:
    """One directory per database, so that events are only ever replayed into the database they belong to."""
    return root / hashlib.sha256(db_url.encode()).hexdigest()[:16]


def encode_row(row: dict[str, Any], seq: int) -> str:
    out = jsonable(row)
    out[SEQ_FIELD] = seq
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """Times as ISO text, money (Decimal) as its exact decimal text."""
    return {k: (v.isoformat() if isinstance(v, datetime) else str(v) if isinstance(v, Decimal) else v)
            for k, v in row.items()}


def decode_row(line: str) -> tuple[int, dict[str, Any]]:
    row = json.loads(line)
    seq = int(row.pop(SEQ_FIELD, -1))
    return seq, from_jsonable(row)


def from_jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The inverse of jsonable() for a usage event's fields."""
    if isinstance(row.get("created_at"), str):
        row["created_at"] = datetime.fromisoformat(row["created_at"])
    if "cost_usd" in row:
        row["cost_usd"] = dollars(row["cost_usd"])
    return row


def read_segment(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a segment; a torn last line (the writer died mid-write) is skipped."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            rows.append(decode_row(line))
    return rows


def append_dead_letter(directory: Path, row: dict[str, Any], error: str) -> Path:
    """Sets aside an event the database refused, with its reason; returns the dead-letter file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / DEAD_LETTER_FILE
    out = jsonable(row)
    out[ERROR_FIELD] = error
    line = json.dumps(out, separators=(",", ":")) + "\n"  # ASCII: whatever odd text made the row fail is kept escaped
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return path


class SpillDir:
    """One process's spill segments in `path`, plus access to the orphaned segments of dead processes.
    Not thread-safe: the ledger serialises calls with its own lock."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock_file: IO[str] | None = None  # taken with the first segment: until then nothing is on disk
        self._open: IO[str] | None = None
        self._open_path: Path | None = None
        self._next_segment = 0
        self._sealed: list[Path] = []

    def append(self, rows: list[tuple[int, dict[str, Any]]]) -> None:
        if self._lock_file is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_file = (self.path / f"usage-{self.owner}.lock").open("w")
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if self._open is None:
            self._open_path = self.path / f"usage-{self.owner}-{self._next_segment:06d}.jsonl"
            self._next_segment += 1
            self._open = self._open_path.open("a", encoding="utf-8")
        self._open.write("".join(encode_row(row, seq) + "\n" for seq, row in rows))
        self._open.flush()  # in the OS's hands: a crash of this process loses nothing

    def seal(self) -> list[Path]:
        """Closes the segment being appended to and returns every segment of this process, oldest first."""
        if self._open is not None:
            self._sync_and_close()
            assert self._open_path is not None
            self._sealed.append(self._open_path)
        return list(self._sealed)

    def remove(self, segment: Path) -> None:
        segment.unlink(missing_ok=True)
        if segment in self._sealed:
            self._sealed.remove(segment)

    @property
    def has_segments(self) -> bool:
        return self._open is not None or bool(self._sealed)

    def sync(self) -> None:
        if self._open is not None:
            self._open.flush()
            os.fsync(self._open.fileno())

    def close(self) -> None:
        """Keeps the segments (a later process replays them) and releases this process's lock."""
        if self._open is not None:
            self._sync_and_close()
        if self._lock_file is None:
            return
        if not self.has_segments_on_disk():
            (self.path / f"usage-{self.owner}.lock").unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None
        try:
            self.path.rmdir()  # only when empty: nothing is waiting here
        except OSError:
            pass

    def has_segments_on_disk(self) -> bool:
        return any(self.path.glob(f"usage-{self.owner}-*.jsonl"))

    def orphans(self) -> Iterator[tuple[Path, list[Path]]]:
        """(lock file, its segments oldest first) of each dead process, locked by this one while iterated;
        the caller deletes the segments it replayed, then this removes the lock file."""
        if not self.path.is_dir():
            return
        owners = {p.name[len("usage-"):-len(".lock")] for p in self.path.glob("usage-*.lock")}
        owners |= {p.name[len("usage-"):].rsplit("-", 1)[0] for p in self.path.glob(SEGMENT_GLOB)}
        owners.discard(self.owner)
        for owner in sorted(owners):
            lock_path = self.path / f"usage-{owner}.lock"
            with lock_path.open("a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is alive and owns them
                segments = sorted(self.path.glob(f"usage-{owner}-*.jsonl"))
                yield lock_path, segments
                if not any(p.exists() for p in segments):
                    lock_path.unlink(missing_ok=True)
        if self._lock_file is None:
            try:
                self.path.rmdir()  # only when empty
            except OSError:
                pass

    def _sync_and_close(self) -> None:
        assert self._open is not None
        self._open.flush()
        os.fsync(self._open.fileno())
        self._open.close()
        self._open = None
