"""Shared pieces of the report queries: a database given as a URL or an Engine, the day bucket of a
timestamp column, the [since, until) window, and the test for one tag in an event's tags."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, timezone
from typing import Any, Union

from sqlalchemy import Engine, Select, String, cast, func

from billing.db import make_engine

Db = Union[str, Engine]
When = Union[datetime, date, None]


@contextmanager
def connect_engine(db: Db) -> Iterator[Engine]:
    """The Engine itself, or one made from the URL and disposed afterwards."""
    if isinstance(db, Engine):
        yield db
        return
    engine = make_engine(db)
    try:
        yield engine
    finally:
        engine.dispose()


def as_datetime(when: When) -> datetime | None:
    """A date means its midnight UTC; a naive datetime is taken as UTC."""
    if when is None:
        return None
    if not isinstance(when, datetime):
        return datetime(when.year, when.month, when.day, tzinfo=timezone.utc)
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def day_of(column: Any) -> Any:
    """YYYY-MM-DD of a timestamp column, the same text on SQLite and PostgreSQL (as billing.usage does)."""
    return func.substr(cast(column, String), 1, 10)


def within(query: Select, column: Any, since: When, until: When) -> Select:
    start, end = as_datetime(since), as_datetime(until)
    if start is not None:
        query = query.where(column >= start)
    if end is not None:
        query = query.where(column < end)
    return query
