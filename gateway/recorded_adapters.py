"""An engine starting (a `serve --local` gateway, a Ray Serve replica started by autoscaling or by a request after
scale to zero) loads the adapters added to its model at run time, as the database records them."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import Engine

from billing.model_adapters import AdapterRecord, recorded_adapters
from gateway.backends import BackendUnavailable, LocalEngineBackend

log = logging.getLogger("tollgate.adapters")


async def load_recorded_adapters(backend: LocalEngineBackend, db: Engine) -> list[AdapterRecord]:
    """The model's recorded adapters that its engine serves now (a spec's adapter of the same name wins; one that
    no longer loads is logged and left out)."""
    served = backend.adapters()
    loaded = []
    for record in await asyncio.to_thread(recorded_adapters, db, backend.spec.name):
        if record.name in served:
            continue
        try:
            await backend.add_adapter(record.name, record.source)
        except (ValueError, BackendUnavailable) as e:
            log.error("adapter %s:%s not served: %s", record.model, record.name, e)
            continue
        loaded.append(record)
    return loaded
