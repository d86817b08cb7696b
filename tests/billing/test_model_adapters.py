"""The run-time adapters' table: one row per model and name (a second gateway adding the same name is refused), kept
with its tenants and prices, deleted by remove."""

from __future__ import annotations

import pytest

from billing.model_adapters import AdapterRecord, DuplicateAdapter, delete_adapter, record_adapter, recorded_adapters
from billing.money import dollars
from billing.pricing import Prices


def test_adapters_are_kept_with_tenants_and_prices_one_per_model_and_name(db):
    priced = AdapterRecord("m", "legal", "/a/legal", ("acme", "globex"), Prices(dollars("0.08"), dollars("0.2")))
    record_adapter(db, priced)
    record_adapter(db, AdapterRecord("m", "plain", "/a/plain"))
    record_adapter(db, AdapterRecord("other", "legal", "/b/legal"))  # the same name over another model
    with pytest.raises(DuplicateAdapter, match="^name: model `m` already has an adapter `legal`"):
        record_adapter(db, AdapterRecord("m", "legal", "/elsewhere"))
    assert recorded_adapters(db, "m") == [priced, AdapterRecord("m", "plain", "/a/plain")]
    assert len(recorded_adapters(db)) == 3
    assert delete_adapter(db, "m", "legal") and not delete_adapter(db, "m", "legal")
    assert [a.name for a in recorded_adapters(db, "m")] == ["plain"]
