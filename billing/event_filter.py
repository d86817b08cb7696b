"""Which usage events a report covers: exact filters on tenant (by name), key (by id), model (as asked:
`model:adapter` for an adapter's requests, billing/asked_model.py), status, end
user, tag and cache hit, and a [since, until) window on the time the event was recorded. Values are checked
when the filter is made (billing/field_checks.py) and reach SQL only as bound parameters compared with `=`,
never LIKE: any text is data."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, literal, select

from billing.asked_model import is_asked_model
from billing.field_checks import MAX_SQL_INT, FieldError, optional_text_field
from billing.models import Tenant, UsageEvent
from billing.report_query import as_datetime

STATUSES = ("ok", "failed", "cancelled", "interrupted")


def tag_elements(dialect: str) -> Any:
    """The elements of usage_events.tags (a JSON array of text) as a table-valued function with column
    `value`, to join beside usage_events (LATERAL on PostgreSQL, implicitly)."""
    each = "json_array_elements_text" if dialect == "postgresql" else "json_each"
    return getattr(func, each)(UsageEvent.tags).table_valued("value")


def has_tag(dialect: str, tag: str) -> Any:
    """EXISTS an element of the event's tags equal to `tag`."""
    elements = tag_elements(dialect)
    return select(literal(1)).select_from(elements).where(elements.c.value == tag).exists()


@dataclass(frozen=True)
class EventFilter:
    tenant: str | None = None
    key_id: int | None = None
    model: str | None = None
    status: str | None = None
    end_user: str | None = None
    tag: str | None = None
    cache_hit: bool | None = None  # True: answered from the semantic cache; False: run by a model
    since: datetime | None = None  # inclusive
    until: datetime | None = None  # exclusive

    def __post_init__(self) -> None:
        for field in ("tenant", "model", "end_user", "tag"):
            optional_text_field(field, getattr(self, field))
        if self.key_id is not None and (isinstance(self.key_id, bool) or not 0 < self.key_id <= MAX_SQL_INT):
            raise FieldError(f"key: expected a key id from 1 to {MAX_SQL_INT}, got {self.key_id!r}")
        if self.status is not None and self.status not in STATUSES:
            raise FieldError(f"status: expected one of {', '.join(STATUSES)}, got {self.status!r}")
        since, until = as_datetime(self.since), as_datetime(self.until)
        if since is not None and until is not None and until <= since:
            raise FieldError("until: must be after since")
        object.__setattr__(self, "since", since)
        object.__setattr__(self, "until", until)

    def apply(self, q: Select, dialect: str) -> Select:
        """`q` narrowed to the events that pass; it selects from usage_events, joined or not."""
        ev = UsageEvent
        if self.tenant is not None:
            q = q.where(ev.tenant_id.in_(select(Tenant.id).where(Tenant.name == self.tenant).scalar_subquery()))
        for column, value in ((ev.api_key_id, self.key_id), (ev.status, self.status), (ev.end_user, self.end_user),
                              (ev.cache_hit, self.cache_hit)):
            if value is not None:
                q = q.where(column == value)
        if self.model is not None:
            q = q.where(is_asked_model(self.model))
        if self.tag is not None:
            q = q.where(has_tag(dialect, self.tag))
        if self.since is not None:
            q = q.where(ev.created_at >= self.since)
        if self.until is not None:
            q = q.where(ev.created_at < self.until)
        return q
