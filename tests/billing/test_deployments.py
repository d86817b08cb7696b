"""Recording the deployed specs: gateways that start together (the API processes of `serve --local --api-servers N`,
replicas of the gateway on Ray Serve) each record the same specs at once, and none of them may fail for it."""

from __future__ import annotations

import threading

from billing.db import make_engine
from billing.deployments import deployments, record_deployments
from billing.money import dollars


def test_gateways_recording_the_same_new_specs_at_once_all_succeed(db_url: str) -> None:
    engines = [make_engine(db_url) for _ in range(6)]
    errors: list[BaseException] = []
    for round_ in range(5):
        specs = [{"name": f"model-{round_}-{i}", "pricing": {"input_per_1m": 0.5 + i}} for i in range(4)]
        start = threading.Barrier(len(engines))

        def record(engine) -> None:  # type: ignore[no-untyped-def]
            start.wait()
            try:
                record_deployments(engine, specs)
            except BaseException as e:  # noqa: BLE001 - the test reports them
                errors.append(e)

        threads = [threading.Thread(target=record, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:2]
    recorded = deployments(engines[0])
    assert len(recorded) == 20 and recorded["model-4-3"].input_per_1m == dollars("3.5")
    for e in engines:
        e.dispose()
