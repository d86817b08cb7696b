"""Prometheus metrics, one registry per app (so two apps can live in one process)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
MAX_TENANT_LABELS = 200  # spend per tenant: later tenants share the label OTHER_TENANT
OTHER_TENANT = "_other"

EngineStats = Callable[[], dict[str, dict[str, Any]]]
GpuMemory = Callable[[], list[tuple[str, int, int]]]  # (gpu index, used bytes, total bytes)


class _EngineStats(Collector):
    """The engines' own series, named as vLLM names its `vllm:` ones where they mean the same (num_requests_running,
    kv_cache_usage_perc, prefix_cache_queries/hits, num_preemptions, prompt/generation tokens), plus every numeric
    engine stat as tollgate_engine_<name>{model}."""

    def __init__(self, source: EngineStats) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["model"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["model"])

        running = gauge("tollgate_num_requests_running", "Requests in the engine's running batch")
        waiting = gauge("tollgate_num_requests_waiting", "Requests queued for the engine")
        kv = gauge("tollgate_kv_cache_usage_perc", "KV-cache blocks in use / total (1 = full)")
        queries = counter("tollgate_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        hits = counter("tollgate_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        preemptions = counter("tollgate_num_preemptions", "Sequences preempted (recomputed later)")
        prompt = counter("tollgate_prompt_tokens", "Prompt tokens the engine computed or found cached")
        generation = counter("tollgate_generation_tokens", "Tokens the engine generated")
        busy = counter("tollgate_model_busy_seconds", "Engine time with work")
        idle = counter("tollgate_model_idle_seconds", "Engine time without work")
        active = gauge("tollgate_model_engine_busy", "1 while the engine has requests, else 0")
        for model, stats in self._source().items():
            for name, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    fam = families.setdefault(name, GaugeMetricFamily(f"tollgate_engine_{name}",
                                                                      f"engine stat {name}", labels=["model"]))
                    fam.add_metric([model], float(value))
            if "num_running" in stats:
                running.add_metric([model], float(stats["num_running"]))
                waiting.add_metric([model], float(stats.get("num_waiting", 0)))
                active.add_metric([model], 1.0 if stats["num_running"] or stats.get("num_waiting") else 0.0)
            if "kv_cache_usage" in stats:
                kv.add_metric([model], float(stats["kv_cache_usage"]))
            if "prompt_tokens_cached" in stats and "prompt_tokens_computed" in stats:
                cached, computed = float(stats["prompt_tokens_cached"]), float(stats["prompt_tokens_computed"])
                queries.add_metric([model], cached + computed)
                hits.add_metric([model], cached)
                prompt.add_metric([model], cached + computed)
            if "num_preemptions" in stats:
                preemptions.add_metric([model], float(stats["num_preemptions"]))
            if "generation_tokens" in stats:
                generation.add_metric([model], float(stats["generation_tokens"]))
            if "busy_seconds" in stats and "idle_seconds" in stats:
                busy.add_metric([model], float(stats["busy_seconds"]))
                idle.add_metric([model], float(stats["idle_seconds"]))
        yield from families.values()
        yield from (running, waiting, kv, queries, hits, preemptions, prompt, generation, busy, idle, active)


class _GpuMemory(Collector):
    def __init__(self, source: GpuMemory) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("tollgate_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("tollgate_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        for gpu, u, t in self._source():
            used.add_metric([gpu], float(u))
            total.add_metric([gpu], float(t))
        yield from (used, total)


def nvml_memory() -> list[tuple[str, int, int]]:
    """Memory of this host's visible GPUs through NVML; nothing where pynvml or a GPU is missing."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            out.append((str(i), int(info.used), int(info.total)))
        return out
    except Exception:
        return []


class _Refreshed:
    """A value read at most every ttl_s; a failed read (a database hiccup) keeps the last value
    rather than failing the scrape."""

    def __init__(self, read: Callable[[], Any], ttl_s: float, initial: Any) -> None:
        self._read, self._ttl_s, self._value = read, ttl_s, initial
        self._lock = threading.Lock()
        self._at = float("-inf")

    def get(self) -> Any:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self._ttl_s:
                try:
                    self._value = self._read()
                except Exception:
                    pass
                self._at = now
            return self._value


class _BudgetUse(Collector):
    """Spend this month / monthly budget per budgeted tenant, read from the database at most every ttl_s."""

    def __init__(self, db: Engine, ttl_s: float) -> None:
        from billing.budget_use import tenant_budget_use
        from billing.periods import month_of

        self._rows = _Refreshed(lambda: tenant_budget_use(db, month_of(time.time())), ttl_s, [])

    def _current(self) -> list[Any]:
        return self._rows.get()

    def collect(self) -> Iterator[Metric]:
        ratio = GaugeMetricFamily("tollgate_tenant_budget_used_ratio", "Spend this month / monthly budget",
                                  labels=["tenant"])
        spent = GaugeMetricFamily("tollgate_tenant_month_spend_usd", "Spend this month (budgeted tenants)",
                                  labels=["tenant"])
        for row in self._current():
            ratio.add_metric([row.tenant], row.ratio)
            spent.add_metric([row.tenant], float(row.spent_usd))
        yield from (ratio, spent)


class _GpuIdleRate(Collector):
    """Per model, the share of replica time in the last `window_s` in which the engine had no work
    (from ReplicaInterval rows, which every replica writes)."""

    def __init__(self, db: Engine, ttl_s: float, window_s: float) -> None:
        self._rates = _Refreshed(lambda: self._read(db, window_s), ttl_s, {})

    @staticmethod
    def _read(db: Engine, window_s: float) -> dict[str, float]:
        from datetime import datetime, timedelta, timezone

        from billing.reports import gpu_by_model

        frame = gpu_by_model(db, since=datetime.now(timezone.utc) - timedelta(seconds=window_s))
        return {row.model: float(row.idle_rate) for row in frame.itertuples() if row.alive_h > 0}

    def collect(self) -> Iterator[Metric]:
        idle = GaugeMetricFamily("tollgate_model_gpu_idle_ratio",
                                 "Share of replica time with no work, over the last hour", labels=["model"])
        for model, rate in self._rates.get().items():
            idle.add_metric([model], rate)
        yield idle


class _Replicas(Collector):
    def __init__(self, source: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily("tollgate_model_replicas", "Replicas of each model by state",
                                     labels=["model", "state"])
        for model, states in self._source().items():
            for state, count in states.items():
                replicas.add_metric([model, state], float(count))
        yield replicas


class _RequestSeries:
    """The labelled series one (model, endpoint, status) moves, looked up once rather than per request."""

    def __init__(self, m: Metrics, model: str, endpoint: str, status: str) -> None:
        self.requests = m.requests.labels(model, endpoint, status)
        self.prompt_tokens = m.tokens.labels(model, "prompt")
        self.completion_tokens = m.tokens.labels(model, "completion")
        self.cost = m.cost.labels(model)
        self.latency = m.latency.labels(model)
        self.ttft = m.ttft.labels(model)
        self.tpot = m.tpot.labels(model)
        self.queue_time = m.queue_time.labels(model)


BACKLOG_PUBLISH_S = 2.0  # with several API processes: how often each writes its ledger backlog for the others' scrapes


class Metrics:
    def __init__(self, engine_stats: EngineStats, ledger_backlog: Callable[[], int], *,
                 gpu_memory: GpuMemory | None = nvml_memory) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tollgate_requests", "Requests that reached a model, by outcome",
                                ["model", "endpoint", "status"], registry=r)
        self.rejected = Counter("tollgate_rejected_requests", "Requests refused before the model",
                                ["status", "code"], registry=r)
        self.tokens = Counter("tollgate_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.cost = Counter("tollgate_cost_usd", "Cost charged", ["model"], registry=r)
        self.latency = Histogram("tollgate_e2e_request_latency_seconds", "Request latency, end to end", ["model"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tollgate_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tollgate_time_per_output_token_seconds", "Time per output token after the first",
                              ["model"], buckets=_TPOT_BUCKETS, registry=r)
        self.itl = Histogram("tollgate_inter_token_latency_seconds",
                             "Time between streamed tokens (a chunk of k tokens after a gap g counts k times g/k)",
                             ["model"], buckets=_TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram("tollgate_request_queue_time_seconds",
                                    "Time from reaching the engine to its first scheduled step", ["model"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_hits = Counter("tollgate_cache_hits", "Requests answered from the semantic cache", ["model"],
                                  registry=r)
        self.cache_saved = Counter("tollgate_cache_saved_usd", "List price of the answers the cache gave",
                                   ["model"], registry=r)
        self.tenant_spend = Counter("tollgate_tenant_spend_usd", "Cost charged per tenant", ["tenant"], registry=r)
        self._series: dict[tuple[str, str, str], _RequestSeries] = {}
        self._tenant_labels: set[str] = set()
        self._tenant_lock = threading.Lock()
        # several API processes (serve --local --api-servers N) share their counts through prometheus_client's
        # multiprocess files: /metrics from any of them shows all; the backlog is then each one's sum
        self._multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self._ledger_backlog = ledger_backlog
        self._backlog = Gauge("tollgate_ledger_backlog", "Usage events not yet written", registry=r,
                              multiprocess_mode="livesum")
        if self._multiprocess_dir is None:
            self._backlog.set_function(lambda: float(ledger_backlog()))
        else:
            threading.Thread(target=self._publish_backlog, name="tollgate-metrics-backlog", daemon=True).start()
        self._collectors: list[Any] = []  # read at scrape time: the same whichever process is asked
        self._watch(_EngineStats(engine_stats))
        if gpu_memory is not None:
            self._watch(_GpuMemory(gpu_memory))

    def _publish_backlog(self) -> None:
        while True:
            self._backlog.set(float(self._ledger_backlog()))
            time.sleep(BACKLOG_PUBLISH_S)

    def _watch(self, collector: Any) -> None:
        self.registry.register(collector)
        self._collectors.append(collector)

    def cache_hit(self, model: str, saved_usd: float | Decimal = 0.0) -> None:
        self.cache_hits.labels(model).inc()
        if saved_usd > 0:
            self.cache_saved.labels(model).inc(float(saved_usd))

    def add_spend(self, tenant: str, usd: float | Decimal) -> None:
        if usd > 0:
            self.tenant_spend.labels(self._tenant_label(tenant)).inc(float(usd))

    def request_done(self, model: str, endpoint: str, status: str, prompt_tokens: int, completion_tokens: int,
                     cost: float | Decimal, latency_s: float, ttft_s: float | None, queue_s: float | None,
                     tpot: bool = True) -> None:
        """A request that reached a model ended: its count, tokens, cost and latencies (`tpot`: its time per output
        token too, (end-to-end − first token) / (tokens − 1), where it has a first-token time and two tokens)."""
        series = self._series.get((model, endpoint, status))
        if series is None:
            series = self._series[(model, endpoint, status)] = _RequestSeries(self, model, endpoint, status)
        series.requests.inc()
        series.prompt_tokens.inc(prompt_tokens)
        series.completion_tokens.inc(completion_tokens)
        series.cost.inc(float(cost))
        series.latency.observe(latency_s)
        if ttft_s is not None:
            series.ttft.observe(ttft_s)
            if tpot and completion_tokens > 1 and latency_s >= ttft_s:
                series.tpot.observe((latency_s - ttft_s) / (completion_tokens - 1))
        if queue_s is not None:
            series.queue_time.observe(queue_s)

    def watch_budgets(self, db: Engine, ttl_s: float = 15.0) -> None:
        """Export tollgate_tenant_budget_used_ratio, read from the database at scrape time (cached ttl_s)."""
        self._watch(_BudgetUse(db, ttl_s))

    def watch_gpu_idle(self, db: Engine, ttl_s: float = 15.0, window_s: float = 3600.0) -> None:
        """Export tollgate_model_gpu_idle_ratio from the replicas' interval rows (cached ttl_s)."""
        self._watch(_GpuIdleRate(db, ttl_s, window_s))

    def watch_replicas(self, source: Callable[[], dict[str, dict[str, int]]]) -> None:
        """Export tollgate_model_replicas{model, state} from `source`: model -> state -> count."""
        self._watch(_Replicas(source))

    def _tenant_label(self, tenant: str) -> str:
        with self._tenant_lock:
            if tenant in self._tenant_labels:
                return tenant
            if len(self._tenant_labels) < MAX_TENANT_LABELS:
                self._tenant_labels.add(tenant)
                return tenant
            return OTHER_TENANT

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        self._backlog.set(float(self._ledger_backlog()))
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self._multiprocess_dir)
        for collector in self._collectors:
            merged.register(collector)
        return generate_latest(merged)
