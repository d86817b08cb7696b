"""The model replicas' engine counters, for the gateway's /metrics: each replica posts its engine's stats to one named
actor every few seconds, and the gateway's registry reads them all with one call and adds up each model's replicas.
The replicas push rather than the gateway asking them: a call through a model's handle could wake a model that has
scaled to zero, and would reach only one replica of several."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

BOARD_NAME = "tollgate-engine-stats"
BOARD_NAMESPACE = "tollgate"
POST_EVERY_S = 2.0
STALE_AFTER_S = 10.0  # a replica that stopped posting (gone, or its node) no longer counts
# per-replica figures that do not add up across replicas: left out of a model's sum (the gateway measures latency
# percentiles itself) or worked out again from the sums
_NOT_ADDED = {"kv_cache_usage", "generation_tokens_per_s", "spec_acceptance_rate", "spec_mean_accepted_length",
              "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "load_seconds", "device_free_bytes",
              "device_total_bytes"}


@ray.remote(num_cpus=0)
class EngineStatsBoard:
    def __init__(self) -> None:
        self._posts: dict[str, dict[str, tuple[float, dict[str, Any]]]] = {}

    def post(self, model: str, replica: str, stats: dict[str, Any]) -> None:
        self._posts.setdefault(model, {})[replica] = (time.time(), stats)

    def drop(self, model: str, replica: str) -> None:
        self._posts.get(model, {}).pop(replica, None)

    def read(self) -> dict[str, list[dict[str, Any]]]:
        """Each model's replicas' latest stats, the stale ones left out."""
        now = time.time()
        return {model: [stats for at, stats in replicas.values() if now - at <= STALE_AFTER_S]
                for model, replicas in self._posts.items()}


def board() -> Any:
    return EngineStatsBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, lifetime="detached",
                                    get_if_exists=True).remote()


def model_totals(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's engine stats over its replicas: counts and seconds added up, the KV-cache share worked out again."""
    totals: dict[str, float] = {}
    for stats in replicas:
        for name, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in _NOT_ADDED:
                totals[name] = totals.get(name, 0) + value
    if totals.get("kv_blocks_total"):
        totals["kv_cache_usage"] = totals.get("kv_blocks_used", 0) / totals["kv_blocks_total"]
    return totals


class StatsPoster:
    """A replica's thread posting its engine's stats to the board every POST_EVERY_S until closed."""

    def __init__(self, model: str, replica: str, read_stats: Any, on_post: Any = None) -> None:
        """`on_post(stats)`: called with each posted value too (the replica's node memory record)."""
        self.model, self.replica, self._read, self._on_post = model, replica, read_stats, on_post
        self._board = board()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tollgate-stats-poster", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POST_EVERY_S):
            try:
                stats = self._read()
                self._board.post.remote(self.model, self.replica, stats)
            except Exception:  # the board is gone (the platform stopping): nothing to post to
                return
            if self._on_post is not None:
                self._on_post(stats)

    def close(self) -> None:
        self._stop.set()
        try:
            self._board.drop.remote(self.model, self.replica)
        except Exception:
            pass
