"""Key checks while the key database is unreachable: which errors mean an outage (as opposed to a
statement the database refused), and an admin-key check that answers an outage with the same 503 an
unknown API key gets, never a 500."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from billing.admin_keys import check_admin_key
from gateway.errors import database_unavailable
from gateway.outage_log import warn_once


def is_database_outage(error: DBAPIError) -> bool:
    """The database could not be reached (refused or lost connection, locked or missing SQLite file)."""
    return isinstance(error, OperationalError) or error.connection_invalidated


def checked_admin_key(db: Engine, key: str, env_key: str | None) -> int | None:
    """check_admin_key, or a 503 APIError (Retry-After) when the database is unreachable. The configured
    TOLLGATE_ADMIN_KEY needs no database and is still admitted during an outage."""
    try:
        return check_admin_key(db, key, env_key)
    except DBAPIError as error:
        if not is_database_outage(error):
            raise
        warn_once("admin key database unreachable; admin keys other than TOLLGATE_ADMIN_KEY get 503")
        raise database_unavailable() from None
