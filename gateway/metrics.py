"""Prometheus metrics, one registry per app (so two apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineStats(Collector):
    def __init__(self, source: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for model, stats in self._source().items():
            for name, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    fam = families.setdefault(name, GaugeMetricFamily(f"tollgate_engine_{name}",
                                                                      f"engine stat {name}", labels=["model"]))
                    fam.add_metric([model], float(value))
        yield from families.values()


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, dict[str, Any]]], ledger_backlog: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tollgate_requests", "Requests that reached a model, by outcome",
                                ["model", "endpoint", "status"], registry=r)
        self.rejected = Counter("tollgate_rejected_requests", "Requests refused before the model",
                                ["status", "code"], registry=r)
        self.tokens = Counter("tollgate_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.cost = Counter("tollgate_cost_usd", "Cost charged", ["model"], registry=r)
        self.latency = Histogram("tollgate_request_latency_seconds", "Request latency", ["model"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tollgate_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        backlog = Gauge("tollgate_ledger_backlog", "Usage events not yet written", registry=r)
        backlog.set_function(lambda: float(ledger_backlog()))
        r.register(_EngineStats(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
