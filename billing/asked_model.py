"""The model as its client asked for it: the base model, or `model:adapter` for a LoRA adapter's requests. Invoices,
usage groups, the request log and its filters all name models so, so that an adapter's line, row and link count the
same requests."""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, case

from billing.models import UsageEvent

SEPARATOR = ":"


def asked_name(model: str, adapter: str | None) -> str:
    return model if adapter is None else f"{model}{SEPARATOR}{adapter}"


def asked_model() -> ColumnElement[str]:
    """usage_events' model as asked, in SQL."""
    ev = UsageEvent
    return case((ev.adapter.is_(None), ev.model), else_=ev.model + SEPARATOR + ev.adapter)


def is_asked_model(name: str) -> ColumnElement[bool]:
    """The events whose model as asked is `name` (the base model compared on its own column, which is indexed)."""
    ev = UsageEvent
    model, sep, adapter = name.partition(SEPARATOR)
    if sep:
        return and_(ev.model == model, ev.adapter == adapter)
    return and_(ev.model == name, ev.adapter.is_(None))
