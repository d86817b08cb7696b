"""The semantic cache as one Ray Serve deployment that every gateway replica shares, so an answer
stored through one gateway is a hit through all of them. Gateways reach it through `ServeCacheClient`,
which has the cache's own lookup/store/flush API; when the deployment is down, lookups raise and the
gateway sends the request to the model (gateway/answer_reuse.py)."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.exceptions import RequestCancelledError

from cache.namespace import Namespace
from cache.store import FlagRecord
from cache.types import Flagged, Hit, Lookup
from gateway.app import open_semantic_cache
from gateway.serving.names import HEAD_NODE_ONLY
from gateway.settings import Settings

LOOKUP_TIMEOUT_S = 1.0  # a lookup takes milliseconds; past this the model answers instead
STORE_TIMEOUT_S = 10.0  # stores run after the response, off the request path


@serve.deployment(name="SemanticCache", num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE_ONLY})
class SemanticCacheServer:
    def __init__(self, settings: Settings) -> None:
        self.cache = open_semantic_cache(settings)
        if self.cache is None:
            raise RuntimeError("the semantic cache could not start (see the replica's log)")

    def lookup(self, namespace: Namespace, prompt: str) -> Hit | None:
        return self.cache.lookup(namespace, prompt)

    def consult(self, namespace: Namespace, prompt: str, max_false_hit_rate: float | None) -> Lookup:
        return self.cache.consult(namespace, prompt, None, max_false_hit_rate)

    def learn(self, namespace: Namespace, entry_id: int, score: float, answer: str,
              explored: bool = False) -> bool | None:
        return self.cache.learn(namespace, entry_id, score, answer, None, explored)

    def note_served(self, response_id: str, namespace: Namespace, lookup: Lookup) -> None:
        self.cache.note_served(response_id, namespace, lookup)

    def flag(self, tenant: str, response_id: str) -> Flagged | None:
        return self.cache.flag(tenant, response_id)

    def store(self, namespace: Namespace, prompt: str, answer: str, usage: dict[str, Any]) -> int:
        return self.cache.store(namespace, prompt, answer, usage)

    def flagged(self, tenant: str | None = None, limit: int = 100) -> list[FlagRecord]:
        return self.cache.flagged(tenant, limit)

    def tenant_report(self) -> dict[str, dict[str, Any]]:
        return self.cache.tenant_report()

    def flush(self, tenant: str) -> int:
        return self.cache.flush(tenant)

    def __del__(self) -> None:
        if getattr(self, "cache", None) is not None:
            self.cache.close()


class ServeCacheClient:
    """Blocking calls to the shared cache deployment; the gateway makes them from worker threads."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def lookup(self, namespace: Namespace, prompt: str) -> Hit | None:
        return _result(self.handle.lookup.remote(namespace, prompt), LOOKUP_TIMEOUT_S)

    def consult(self, namespace: Namespace, prompt: str, embedding: None = None,
                max_false_hit_rate: float | None = None) -> Lookup:
        return _result(self.handle.consult.remote(namespace, prompt, max_false_hit_rate), LOOKUP_TIMEOUT_S)

    def learn(self, namespace: Namespace, entry_id: int, score: float, answer: str,
              answer_embedding: None = None, explored: bool = False) -> bool | None:
        return _result(self.handle.learn.remote(namespace, entry_id, score, answer, explored), STORE_TIMEOUT_S)

    def note_served(self, response_id: str, namespace: Namespace, lookup: Lookup) -> None:
        _result(self.handle.note_served.remote(response_id, namespace, lookup), STORE_TIMEOUT_S)

    def flag(self, tenant: str, response_id: str) -> Flagged | None:
        return _result(self.handle.flag.remote(tenant, response_id), STORE_TIMEOUT_S)

    def store(self, namespace: Namespace, prompt: str, answer: str, usage: dict[str, Any]) -> int:
        return _result(self.handle.store.remote(namespace, prompt, answer, usage), STORE_TIMEOUT_S)

    def flagged(self, tenant: str | None = None, limit: int = 100) -> list[FlagRecord]:
        return _result(self.handle.flagged.remote(tenant, limit), STORE_TIMEOUT_S)

    def tenant_report(self) -> dict[str, dict[str, Any]]:
        return _result(self.handle.tenant_report.remote(), STORE_TIMEOUT_S)

    def flush(self, tenant: str) -> int:
        return _result(self.handle.flush.remote(tenant), STORE_TIMEOUT_S)

    def close(self) -> None:
        """The deployment owns the cache; a gateway replica going away leaves it open."""


def _result(response: Any, timeout_s: float) -> Any:
    """The call's result. A call the deployment cancelled (it is stopping) is a ConnectionError, which the gateway
    logs in one line where it goes on without the cache (gateway/answer_reuse.py)."""
    try:
        return response.result(timeout_s=timeout_s)
    except RequestCancelledError as error:
        raise ConnectionError(f"the semantic cache deployment cancelled the call (stopping): {error}") from None
