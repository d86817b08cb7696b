"""The query string of a dashboard view. Each view names the parameters it takes; another parameter, one
given twice, or a value that does not parse is refused with a 400 naming it (an error page, or for a CSV /
JSON export an error in OpenAI's shape): nothing given is silently ignored. An empty value means "any"
(what an untouched form field sends)."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta, timezone
from typing import NoReturn
from urllib.parse import urlencode

from starlette.requests import Request

from billing.event_filter import STATUSES, EventFilter
from billing.field_checks import MAX_SQL_INT, FieldError
from billing.invoice import month_bounds
from gateway.dashboard.guard import Refused
from gateway.dashboard.render import page, secure
from gateway.errors import invalid_request

FORMATS = ("html", "csv", "json")
# the request filters: `key` is a key's id, `user` the end user (the request's OpenAI `user` field), `cache`
# hit (answered from the semantic cache) or miss; `since` and `until` are UTC days (both included) or times
FILTERS = ("tenant", "key", "model", "status", "user", "tag", "cache", "since", "until")
CACHE_CHOICES = {"hit": True, "miss": False}


class ViewQuery:
    def __init__(self, request: Request, takes: tuple[str, ...]) -> None:
        self.path = request.url.path
        self.params: dict[str, str] = {}
        self.format = "html"
        twice = []
        for name, value in request.query_params.multi_items():
            if name in self.params:
                twice.append(name)
            self.params[name] = value
        self.format = self.choice("format", FORMATS, "html") if "format" not in twice else "html"
        for name in twice:
            self.refuse(name, "given more than once")
        for name in self.params:
            if name not in takes and name != "format":
                self.refuse(name, f"this view takes no such parameter (it takes {', '.join(takes)}, format)")

    def refuse(self, name: str, message: str) -> NoReturn:
        text = f"{name}: {message}"
        if self.format == "html":
            raise Refused(page("error.html", 400, title="Bad request", message=text))
        raise Refused(secure(invalid_request(text, name, "invalid_query_parameter").response()))

    def text(self, name: str) -> str | None:
        value = self.params.get(name, "")
        return value if value != "" else None

    def choice(self, name: str, choices: tuple[str, ...], default: str) -> str:
        value = self.text(name)
        if value is None:
            return default
        if value not in choices:
            self.refuse(name, f"expected one of {', '.join(choices)}, got {value[:40]!r}")
        return value

    def whole(self, name: str, default: int, low: int, high: int) -> int:
        value = self.text(name)
        if value is None:
            return default
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            self.refuse(name, f"expected a whole number from {low} to {high}, got {value[:40]!r}")
        return int(value)

    def when(self, name: str, *, end: bool) -> datetime | None:
        """YYYY-MM-DD (a UTC day: its start, or with `end` the start of the next day) or an ISO time
        (naive: UTC)."""
        value = self.text(name)
        if value is None:
            return None
        try:
            if len(value) == 10:
                day = date.fromisoformat(value)
                return datetime.combine(day + timedelta(days=1 if end else 0), time(), timezone.utc)
            moment = datetime.fromisoformat(value)
        except ValueError:
            self.refuse(name, f"expected a UTC day YYYY-MM-DD or a time YYYY-MM-DDTHH:MM, got {value[:40]!r}")
        return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)

    def month(self, name: str, default: str) -> str:
        value = self.text(name) or default
        try:
            month_bounds(value)
        except ValueError:
            self.refuse(name, f"expected a month YYYY-MM, got {value[:40]!r}")
        return value

    def events(self) -> EventFilter:
        """The request filters among this view's parameters."""
        status = self.text("status")
        if status is not None and status not in STATUSES:
            self.refuse("status", f"expected one of {', '.join(STATUSES)}, got {status[:40]!r}")
        cache = self.choice("cache", tuple(CACHE_CHOICES), "")
        key = self.whole("key", 0, 1, MAX_SQL_INT) if self.text("key") is not None else None
        try:
            return EventFilter(tenant=self.text("tenant"), key_id=key, model=self.text("model"), status=status,
                               end_user=self.text("user"), tag=self.text("tag"), cache_hit=CACHE_CHOICES.get(cache),
                               since=self.when("since", end=False), until=self.when("until", end=True))
        except FieldError as e:
            field = str(e).split(":", 1)[0]
            self.refuse({"end_user": "user"}.get(field, field), str(e).split(": ", 1)[-1])

    def link(self, path: str | None = None, **changes: object) -> str:
        """This view's URL (or `path`'s) with these parameters changed; None or "" removes one."""
        params = {k: v for k, v in self.params.items() if k != "format"} if path is None else {}
        for name, value in changes.items():
            params.pop(name, None)
            if value is not None and value != "":
                params[name] = str(value)
        query = urlencode(params)
        return (path or self.path) + (f"?{query}" if query else "")

    def filtered_link(self, path: str, **changes: object) -> str:
        """`path` with this view's request filters, and these changed."""
        kept: dict[str, object] = {k: v for k, v in self.params.items() if k in FILTERS}
        return self.link(path, **{**kept, **changes})
