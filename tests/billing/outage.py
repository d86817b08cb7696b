"""A database a test can take away and give back: a SQLite file locked by an exclusive transaction
the test holds, or PostgreSQL reached through a TCP proxy the test cuts."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from billing.db import make_engine
from tests.billing.tcp_proxy import TcpProxy


@dataclass
class Outage:
    """`url` / `engine`: how the code under test reaches the database (through the lock or the proxy)."""

    url: str
    engine: Engine
    _sqlite_path: str | None = None
    _proxy: TcpProxy | None = None
    _lock: sqlite3.Connection | None = field(default=None, repr=False)

    def take_down(self) -> None:
        if self._proxy is not None:
            self._proxy.cut()
            return
        assert self._sqlite_path is not None
        # in WAL mode readers still read; every writer waits for its busy timeout, then fails
        self._lock = sqlite3.connect(self._sqlite_path, isolation_level=None)
        self._lock.execute("BEGIN EXCLUSIVE")

    def bring_back(self) -> None:
        if self._proxy is not None:
            self._proxy.restore()
            return
        if self._lock is not None:
            self._lock.execute("ROLLBACK")
            self._lock.close()
            self._lock = None

    @contextmanager
    def down(self) -> Iterator[None]:
        self.take_down()
        try:
            yield
        finally:
            self.bring_back()


@contextmanager
def outage_of(db_url: str, busy_timeout_s: float = 0.3) -> Iterator[Outage]:
    """An Outage of the database at db_url; statements through it fail after about busy_timeout_s."""
    if db_url.startswith("sqlite"):
        engine = make_engine(db_url, busy_timeout_s=busy_timeout_s)
        outage = Outage(db_url, engine, _sqlite_path=db_url.split("///", 1)[1])
    else:
        url = make_url(db_url)
        proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
        proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        outage = Outage(proxied, make_engine(proxied, busy_timeout_s=busy_timeout_s), _proxy=proxy)
    try:
        yield outage
    finally:
        outage.bring_back()
        outage.engine.dispose()
        if outage._proxy is not None:
            outage._proxy.close()
