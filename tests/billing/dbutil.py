"""A fresh, migrated database for a test: a SQLite file, or a private schema in the PostgreSQL
database named by TOLLGATE_TEST_DATABASE_URL (so parallel runs never see each other's rows)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text

from billing.migrate import upgrade
from tollgate import envs

PG_URL_VAR = "TOLLGATE_TEST_DATABASE_URL"


@contextmanager
def fresh_database(tmp_dir: Path, migrate: bool = True) -> Iterator[str]:
    base = envs.get(PG_URL_VAR)
    if not base:
        url = f"sqlite:///{tmp_dir / f'tollgate-{uuid.uuid4().hex[:8]}.db'}"
        if migrate:
            upgrade(url)
        yield url
        return
    schema = f"tg_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in base else "?"
    url = f"{base}{sep}options=-csearch_path%3D{schema}"
    try:
        if migrate:
            upgrade(url)
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
