"""Database engines: SQLite (WAL, busy timeout) by default, PostgreSQL through a URL."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, ContextManager

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, *, busy_timeout_s: float = 30.0, **kwargs: Any) -> Engine:
    """`busy_timeout_s`: how long a statement waits for a locked SQLite file, or for a PostgreSQL
    connection, before it fails."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False}, **kwargs)
        event.listen(engine, "connect", lambda conn, record: _sqlite_pragmas(conn, busy_timeout_s))
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if url.startswith("postgresql"):
        kwargs.setdefault("connect_args", {"connect_timeout": max(1, round(busy_timeout_s))})
    return create_engine(url, **kwargs)


def _sqlite_pragmas(dbapi_conn: Any, busy_timeout_s: float) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    cur.close()


_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def write_lock(engine: Engine) -> ContextManager[Any]:
    """Held around a write transaction on the request path (admission) and the ledger's. SQLite lets one connection
    write at a time, and one that finds the file locked sleeps in growing steps (1, 2, 5, 10, 15 ms ...) before it
    looks again: two threads of this process that queue here instead start the moment the other commits. One lock
    per database file, shared by every engine on it. PostgreSQL locks rows: no lock."""
    if engine.dialect.name != "sqlite":
        return contextlib.nullcontext()
    name = engine.url.database or ""
    key = os.path.abspath(name) if name and name != ":memory:" else str(engine.url)
    with _write_locks_guard:
        lock = _write_locks.setdefault(key, threading.Lock())
    return lock


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def dialect_insert(engine: Engine, table: Any) -> Any:
    """INSERT with ON CONFLICT support for the engine's dialect (SQLite and PostgreSQL)."""
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif engine.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"database dialect {engine.dialect.name!r} is not supported")
    return insert(table)
