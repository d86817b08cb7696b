"""SQLite persistence of cache entries and counters (stdlib sqlite3, one file per cache dir)."""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    namespace TEXT NOT NULL,
    prompt TEXT NOT NULL,
    embedding BLOB NOT NULL,
    answer TEXT NOT NULL,
    usage TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries (tenant);
CREATE TABLE IF NOT EXISTS counters (
    tenant TEXT PRIMARY KEY,
    lookups INTEGER NOT NULL DEFAULT 0,
    hits INTEGER NOT NULL DEFAULT 0,
    saved_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    saved_completion_tokens INTEGER NOT NULL DEFAULT 0,
    saved_dollars REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS served (
    response_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    entry_id INTEGER NOT NULL,
    score REAL NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS served_created ON served (created);
CREATE TABLE IF NOT EXISTS flags (
    response_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    entry_id INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    score REAL NOT NULL,
    removed INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS flags_tenant ON flags (tenant, created);
CREATE TABLE IF NOT EXISTS calibrations (
    tenant TEXT PRIMARY KEY,
    state TEXT NOT NULL
);
"""
# columns added after the first release: (table, column, definition); added in place to an older file
ADDED_COLUMNS = (("entries", "labels", "TEXT NOT NULL DEFAULT '[]'"),)


@dataclass
class StoredEntry:
    id: int
    tenant: str
    namespace: str
    prompt: str
    embedding: np.ndarray
    answer: str
    usage: dict[str, Any]
    created: float
    last_used: float
    labels: list | None = None  # cache/learning.py's (score, same question) pairs


@dataclass(frozen=True)
class FlagRecord:
    """A served answer its client flagged as wrong (POST /v1/cache/feedback), kept for the dashboard."""

    response_id: str
    tenant: str
    entry_id: int
    prompt: str  # the cached prompt whose answer was flagged
    score: float
    removed: bool
    created: float


@dataclass(frozen=True)
class ServedRow:
    tenant: str
    entry_id: int
    score: float


class EntryStore:
    """Write-through storage; ':memory:' when the cache has no directory."""

    def __init__(self, path: Path | None) -> None:
        self._lock = threading.Lock()
        target = str(path) if path is not None else ":memory:"
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, column, definition in ADDED_COLUMNS:
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def next_id(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM entries").fetchone()
        return int(row[0]) + 1

    def insert_many(self, entries: list[StoredEntry]) -> None:
        rows = [
            (e.id, e.tenant, e.namespace, e.prompt, e.embedding.astype(np.float32).tobytes(),
             e.answer, json.dumps(e.usage), e.created, e.last_used, json.dumps(e.labels or []))
            for e in entries
        ]
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO entries (id, tenant, namespace, prompt, embedding, answer, usage,"
                " created, last_used, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            self._db.execute("COMMIT")

    def delete(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in ids])
            self._db.execute("COMMIT")

    def delete_tenant(self, tenant: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM entries WHERE tenant = ?", (tenant,))
            self._db.execute("DELETE FROM served WHERE tenant = ?", (tenant,))
            self._db.execute("DELETE FROM calibrations WHERE tenant = ?", (tenant,))
            self._db.execute("DELETE FROM flags WHERE tenant = ?", (tenant,))

    def save_labels(self, entry_id: int, labels: list) -> None:
        with self._lock:
            self._db.execute("UPDATE entries SET labels = ? WHERE id = ?", (json.dumps(labels), entry_id))

    def record_flag(self, flag: FlagRecord) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO flags (response_id, tenant, entry_id, prompt, score, removed,"
                             " created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (flag.response_id, flag.tenant, flag.entry_id, flag.prompt, flag.score, int(flag.removed),
                              flag.created))

    def flags(self, tenant: str | None, limit: int) -> list[FlagRecord]:
        """The latest flags first, of one tenant or all."""
        where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
        with self._lock:
            rows = self._db.execute(
                "SELECT response_id, tenant, entry_id, prompt, score, removed, created FROM flags "
                f"{where} ORDER BY created DESC, response_id LIMIT ?", (*args, limit)).fetchall()
        return [FlagRecord(r[0], r[1], int(r[2]), r[3], float(r[4]), bool(r[5]), float(r[6])) for r in rows]

    def flag_counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT tenant, COUNT(*) FROM flags GROUP BY tenant").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def save_calibration(self, tenant: str, state: dict) -> None:
        """cache/pooled.py's state for one tenant (its recent lookups' scores, its labels, its learned thresholds)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO calibrations (tenant, state) VALUES (?, ?)",
                             (tenant, json.dumps(state)))

    def calibrations(self) -> dict[str, dict]:
        with self._lock:
            rows = self._db.execute("SELECT tenant, state FROM calibrations").fetchall()
        return {r[0]: json.loads(r[1]) for r in rows}

    def record_served(self, response_id: str, tenant: str, entry_id: int, score: float, now: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO served (response_id, tenant, entry_id, score, created)"
                             " VALUES (?, ?, ?, ?, ?)", (response_id, tenant, entry_id, score, now))

    def served(self, response_id: str) -> ServedRow | None:
        with self._lock:
            row = self._db.execute("SELECT tenant, entry_id, score FROM served WHERE response_id = ?",
                                   (response_id,)).fetchone()
        return None if row is None else ServedRow(row[0], int(row[1]), float(row[2]))

    def forget_served_before(self, cutoff: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM served WHERE created < ?", (cutoff,))

    def record_hit(self, entry_id: int, now: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE entries SET last_used = ?, hits = hits + 1 WHERE id = ?", (now, entry_id)
            )

    def bump_counters(
        self, tenant: str, lookups: int, hits: int, prompt_tokens: int, completion_tokens: int, dollars: float
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO counters (tenant, lookups, hits, saved_prompt_tokens, saved_completion_tokens,"
                " saved_dollars) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(tenant) DO UPDATE SET"
                " lookups = lookups + excluded.lookups, hits = hits + excluded.hits,"
                " saved_prompt_tokens = saved_prompt_tokens + excluded.saved_prompt_tokens,"
                " saved_completion_tokens = saved_completion_tokens + excluded.saved_completion_tokens,"
                " saved_dollars = saved_dollars + excluded.saved_dollars",
                (tenant, lookups, hits, prompt_tokens, completion_tokens, dollars),
            )

    def counters(self) -> dict[str, tuple[int, int, int, int, float]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT tenant, lookups, hits, saved_prompt_tokens, saved_completion_tokens, saved_dollars"
                " FROM counters"
            ).fetchall()
        return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5])) for r in rows}

    def load(self) -> Iterator[StoredEntry]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, tenant, namespace, prompt, embedding, answer, usage, created, last_used, labels"
                " FROM entries ORDER BY last_used"
            ).fetchall()
        for r in rows:
            yield StoredEntry(
                int(r[0]), r[1], r[2], r[3], np.frombuffer(r[4], dtype=np.float32).copy(),
                r[5], json.loads(r[6]), float(r[7]), float(r[8]), json.loads(r[9]),
            )
