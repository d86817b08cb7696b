"""The options of the filter form's lists: tenants, keys, deployed models and statuses. A value the query
already filters on is kept among them, so the form shows what the page shows."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from billing.accounts import KeyInfo, list_keys, list_tenants
from billing.deployments import deployments
from billing.event_filter import STATUSES


@dataclass(frozen=True)
class FilterChoices:
    tenants: list[str]
    keys: list[KeyInfo]
    models: list[str]
    statuses: tuple[str, ...] = STATUSES


def filter_choices(db: Engine, params: dict[str, str]) -> FilterChoices:
    def with_current(names: set[str], param: str) -> list[str]:
        return sorted(names | ({params[param]} if params.get(param) else set()))

    return FilterChoices(with_current({t.name for t in list_tenants(db)}, "tenant"), list_keys(db),
                         with_current(set(deployments(db)), "model"))
