from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from billing.db import make_engine
from tests.billing.dbutil import fresh_database


@pytest.fixture
def db_url(tmp_path) -> Iterator[str]:
    with fresh_database(tmp_path) as url:
        yield url


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()
