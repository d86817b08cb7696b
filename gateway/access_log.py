"""uvicorn's access log without secrets: a client may put a key in a query string (`?api_key=...`) or in
the path itself (`/v1/chat/completions/<key>`), and the access log would keep it. Query strings go, and
so does every path segment shaped like a key (our `tg-` / `tga-` keys, `sk-` keys, any long token-like
run); methods, the rest of the path and status codes stay."""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER = "uvicorn.access"
KEY_SHAPED = re.compile(r"^(?:(?:tga?|sk)-[A-Za-z0-9_\-]{8,}|[A-Za-z0-9_\-+=.]{32,})$")


def redact_path(path: str) -> str:
    path, query, _ = path.partition("?")
    segments = ["[redacted]" if KEY_SHAPED.match(s) else s for s in path.split("/")]
    return "/".join(segments) + ("?[query removed]" if query else "")


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (args[0], args[1], redact_path(args[2]), *args[3:])
        return True


def redact_access_log() -> None:
    """Install the filter once on uvicorn's access logger (after uvicorn has configured its logging)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactSecrets) for f in logger.filters):
        logger.addFilter(RedactSecrets())
