"""uvicorn's access log without query strings: a client may put a key or other secret in one
(`?api_key=...`), and the access log would keep it. Paths and status codes stay."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"


class DropQueryStrings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (args[0], args[1], args[2].split("?", 1)[0] + "?[query removed]", *args[3:])
        return True


def drop_query_strings() -> None:
    """Install the filter once on uvicorn's access logger (after uvicorn has configured its logging)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryStrings) for f in logger.filters):
        logger.addFilter(DropQueryStrings())
