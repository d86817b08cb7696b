"""A semantic cache deployment that is stopping cancels the gateway's calls (Ray Serve's RequestCancelledError): the
gateway goes on without the cache and says so in one line, with no traceback in the log."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from ray.serve.exceptions import RequestCancelledError

from cache.namespace import CacheDecision, Namespace
from gateway.answer_reuse import AnswerReuse
from gateway.serving.cache_deployment import ServeCacheClient


class _Cancelled:
    def result(self, timeout_s: float) -> Any:
        raise RequestCancelledError("req-1")


class _Method:
    def remote(self, *args: Any) -> _Cancelled:
        return _Cancelled()


class _StoppingDeployment:
    """A deployment handle whose every call the deployment cancels (injected: what a stopping replica answers)."""

    def __getattr__(self, name: str) -> _Method:
        return _Method()


def _decision() -> CacheDecision:
    return CacheDecision(Namespace(tenant="t1", key="0" * 64), "What is the capital of France?", True)


def test_a_cancelled_call_is_a_connection_error_naming_the_deployment() -> None:
    client = ServeCacheClient(_StoppingDeployment())
    with pytest.raises(ConnectionError, match="semantic cache deployment cancelled the call"):
        client.store(_decision().namespace, "q", "a", {})
    with pytest.raises(ConnectionError):
        client.consult(_decision().namespace, "q")


def test_stores_and_lookups_against_a_stopping_cache_log_one_line_without_a_traceback(caplog) -> None:
    reuse = AnswerReuse(ServeCacheClient(_StoppingDeployment()))  # type: ignore[arg-type]

    async def scenario() -> Any:
        outcome = await reuse.lookup("t1", "m", {"messages": [{"role": "user", "content": "What is 2 + 2?"}],
                                                    "temperature": 0})
        reuse.store_later(_decision(), "Paris", {"prompt_tokens": 3, "completion_tokens": 1})
        while reuse.pending_stores:
            await asyncio.sleep(0.01)
        return outcome

    with caplog.at_level(logging.WARNING, logger="tollgate.gateway"):
        outcome = asyncio.run(scenario())
    assert outcome.decision is None  # no cache decision: the model answers
    records = [r for r in caplog.records if r.name == "tollgate.gateway"]
    assert [r.getMessage().split(":")[0] for r in records] == ["semantic cache lookup skipped",
                                                              "semantic cache store skipped"]
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in records)
