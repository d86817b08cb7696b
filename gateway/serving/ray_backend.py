"""A ModelBackend that calls a model's Ray Serve application through its deployment handle, so the
HTTP layer is the same as with the in-process engine. The first item of every stream is a
ReplicaAccepted marker sent by the replica: waiting for it is waiting for a replica (a cold start
when the replica became ready after the request was sent), bounded by cold_start_timeout_s.

A request the replica refuses comes back as a ReplicaError item, not as an exception: the backend
raises the same typed error the in-process engine would (PromptTooLongError, ValueError,
BackendUnavailable), so the client gets the same 4xx / 503 on both paths."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import PromptTooLongError
from gateway.backends import BackendInfo, BackendState, BackendUnavailable, GenerationChunk, GenerationRequest
from gateway.serving.cluster_fit import node_shortfall
from gateway.specs import ModelSpec

log = logging.getLogger("tollgate.ray_backend")

# the replica's process or node ended under the request (a node lost, a replica killed): Serve starts another.
# ObjectLostError: a stream item stored on the lost node. A RayTaskError whose cause is one of these is an instance
# of it too (Ray makes the wrapper a subclass of its cause's class)
REPLICA_LOST = (RayActorError, NodeDiedError, WorkerCrashedError, ObjectLostError)

COLD_START_HEADER = "x-tollgate-cold-start"
REQUEST_ID_HEADER = "x-tollgate-request-id"

# a per-request mutable holder the middleware installs and the backend fills in
_request_notes: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("tollgate_notes",
                                                                                        default=None)


@dataclass(frozen=True)
class ReplicaAccepted:
    replica: str
    ready_at: float  # wall-clock time at which the replica finished loading
    started_at: float = 0.0  # wall-clock time at which its constructor began
    woke_s: float | None = None  # the seconds this request waited for the replica's engine to wake from sleep


@dataclass(frozen=True)
class ReplicaError:
    """A request the replica refused; `kind` names the exception to raise again on the gateway's side."""

    kind: str  # "prompt_too_long" | "invalid" | "unavailable"
    message: str
    num_prompt_tokens: int = 0
    max_model_len: int = 0
    max_tokens: int | None = None
    at_least: bool = False

    @classmethod
    def of(cls, e: Exception) -> "ReplicaError | None":
        if isinstance(e, PromptTooLongError):
            return cls("prompt_too_long", str(e), e.num_prompt_tokens, e.max_model_len, e.max_tokens, e.at_least)
        if isinstance(e, ValueError):
            return cls("invalid", str(e))
        if isinstance(e, BackendUnavailable):
            return cls("unavailable", str(e))
        return None

    def exception(self) -> Exception:
        if self.kind == "prompt_too_long":
            return PromptTooLongError(self.num_prompt_tokens, self.max_model_len, self.max_tokens, self.at_least)
        if self.kind == "invalid":
            return ValueError(self.message)
        return BackendUnavailable(self.message)


@dataclass
class ModelCounters:
    ongoing: int = 0  # requests between the call and their end
    waiting_for_replica: int = 0
    cold_starts: int = 0  # requests that waited for a replica to start or to wake
    wakes: int = 0  # of those, the ones that woke a sleeping replica (autoscaling.sleep_after_s)
    cold_start_timeouts: int = 0
    last_cold_start_s: float | None = None
    failed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RayModelBackend:
    def __init__(self, name: str, handle: Any, *, max_model_len: int | None, cold_start_timeout_s: float) -> None:
        self.name = name
        self.handle = handle
        self.max_model_len = max_model_len
        self.cold_start_timeout_s = cold_start_timeout_s
        # kept current by the gateway's model registry
        self.spec: ModelSpec | None = None
        self.state: BackendState = "scaled_to_zero"
        self.reason: str | None = None
        self.replica_states: dict[str, int] = {}
        self.counters = ModelCounters()
        self._live: dict[str, Any] = {}
        self.engine_stats: dict[str, Any] = {}  # its replicas' engine counters, added up (engine_stats_board.py)

    def stats(self) -> dict[str, Any]:
        return self.engine_stats

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, self.max_model_len, self.state, self.replica_states.get("running", 0),
                           dict(self.replica_states), self.reason)

    async def abort(self, request_id: str) -> None:
        response = self._live.pop(request_id, None)
        if response is not None:
            _cancel(response)

    async def add_adapter(self, name: str, source: str) -> None:
        """Every running replica loads the adapter (one started later loads the recorded set, and any replica loads it
        on the first request that names it); ValueError when a replica refuses it."""
        for result in await self._broadcast("add_adapter", name, source):
            if isinstance(result, ReplicaError):
                raise result.exception()

    async def remove_adapter(self, name: str) -> bool:
        return any(r is True for r in await self._broadcast("remove_adapter", name))

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """`method` called on each running replica (none at zero replicas), each answer within the cold-start
        bound; replicas that cannot be reached are logged and skipped."""
        if not self.replica_states.get("running"):
            return []
        try:
            results = await self.handle.broadcast(method, *args).results_async(
                timeout_s=self.cold_start_timeout_s, return_exceptions=True)
        except (DeploymentUnavailableError, TimeoutError) as e:
            log.warning("model %s: %s not broadcast to its replicas: %s", self.name, method, type(e).__name__)
            return []
        for result in results:
            if isinstance(result, Exception):
                log.warning("model %s: a replica failed %s: %s", self.name, method, result)
        return [r for r in results if not isinstance(r, Exception)]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        c = self.counters
        sent = time.time()
        response = self.handle.options(stream=True).generate.remote(request)
        self._live[request.request_id] = response
        c.ongoing += 1
        finished = False
        try:
            c.waiting_for_replica += 1
            try:
                accepted = await self._wait_for_replica(response)
            finally:
                c.waiting_for_replica -= 1
            if not isinstance(accepted, ReplicaAccepted):
                raise RuntimeError(f"model {self.name!r}: the replica answered without accepting")
            if accepted.ready_at > sent or accepted.woke_s is not None:
                waited = time.time() - sent if accepted.ready_at > sent else accepted.woke_s
                c.cold_starts += 1
                c.wakes += accepted.ready_at <= sent
                c.last_cold_start_s = waited
                notes = _request_notes.get()
                if notes is not None:
                    notes["cold_start_s"] = waited
            async for chunk in response:
                if isinstance(chunk, ReplicaError):
                    finished = True
                    raise chunk.exception()
                yield chunk
                finished = chunk.finished
        except REPLICA_LOST as e:
            c.failed += 1
            raise self._lost() from e
        except asyncio.CancelledError:
            if _this_task_cancelled():  # the client went away (or the gateway stops): not the replica's doing
                raise
            # Serve's handle turns Ray's TaskCancelledError into CancelledError: a request whose replica's node
            # ended before or while it ran, which this gateway did not cancel
            c.failed += 1
            raise self._lost() from None
        except RayTaskError as e:  # the replica's own exception (ValueError, PromptTooLongError, ...)
            c.failed += 1
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        except (BackendUnavailable, ValueError):
            raise
        except Exception:
            c.failed += 1
            raise
        finally:
            c.ongoing -= 1
            self._live.pop(request.request_id, None)
            if not finished:
                _cancel(response)

    def _lost(self) -> BackendUnavailable:
        return BackendUnavailable(f"The model `{self.name}` lost the replica serving this request (its process or "
                                  "node ended); another is starting, try again shortly")

    async def _wait_for_replica(self, response: Any) -> Any:
        """The stream's first item; gives up with the reason as soon as the registry finds the model
        unavailable (a replica that cannot start), else after cold_start_timeout_s."""
        first = asyncio.ensure_future(response.__anext__())
        deadline = time.monotonic() + self.cold_start_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                if done:
                    return first.result()
                if self.state == "unavailable":
                    raise BackendUnavailable(f"The model `{self.name}` is unavailable: {self.reason}")
                if time.monotonic() >= deadline:
                    self.counters.cold_start_timeouts += 1
                    why = await self._why_no_replica()
                    raise BackendUnavailable(f"The model `{self.name}` has no replica ready after "
                                             f"{self.cold_start_timeout_s:g} s; "
                                             + (f"{why}: try again once the cluster has such a node" if why else
                                                "it is starting, try again shortly"))
        finally:
            if not first.done():
                first.cancel()
                first.add_done_callback(_retrieve_outcome)

    async def _why_no_replica(self) -> str | None:
        """What the cluster lacks for one of this model's replicas (a node lost, or none with its resources); None
        when a node could hold one (the replica is still starting) or when the cluster cannot be asked."""
        if self.spec is None:
            return None
        try:
            return await asyncio.to_thread(node_shortfall, self.spec)
        except Exception as e:  # noqa: BLE001 - the 503 goes out either way, with or without the reason
            log.warning("model %s: could not read the cluster's nodes: %r", self.name, e)
            return None


def _this_task_cancelled() -> bool:
    """Whether the task running this code was asked to stop (asyncio's own cancellation of it), as opposed to a
    CancelledError raised by something it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _cancel(response: Any) -> None:
    """Cancels the replica's side of a request; one whose replica or node is gone may refuse: nothing left to stop."""
    try:
        response.cancel()
    except Exception as e:  # noqa: BLE001 - cleanup after the request's outcome is decided: logged, never raised
        log.warning("could not cancel a model request: %r", e)


def _retrieve_outcome(task: asyncio.Future) -> None:
    """A cancelled wait for the stream's first item ends in the stream's RequestCancelledError, not in
    CancelledError: retrieved here, so asyncio does not print it as a task exception never retrieved."""
    if not task.cancelled():
        task.exception()


class PlatformHeaders:
    """ASGI middleware: `x-tollgate-cold-start: <seconds>` on responses that waited for a replica,
    `Retry-After` on 503s (a model starting or unavailable), and `x-tollgate-request-id`."""

    def __init__(self, app: ASGIApp, retry_after_s: int = 10) -> None:
        self.app = app
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        notes: dict[str, float] = {}
        token = _request_notes.set(notes)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Serve's proxy adds its own X-Request-Id (its trace id) to every response: the gateway's
                # request id goes under our own name, so that a response carries one of each
                headers = []
                for k, v in message.get("headers", []):
                    headers.append((REQUEST_ID_HEADER.encode(), v) if k.lower() == b"x-request-id" else (k, v))
                if "cold_start_s" in notes:
                    headers.append((COLD_START_HEADER.encode(), f"{notes['cold_start_s']:.3f}".encode()))
                if message["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", self.retry_after))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _request_notes.reset(token)
