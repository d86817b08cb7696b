"""The gateway's work for one request after the body is parsed: admission, the model call,
streaming or whole responses, and the usage event that every admitted request leaves."""

from __future__ import annotations

import logging
import time
import uuid
from decimal import Decimal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import Engine

from billing.charged_prices import stored_prices
from billing.db import make_engine
from billing.ledger import Ledger
from billing.money import ZERO
from billing.pricing import request_cost
from billing.reservations import ReservationKeeper, Worst
from cache.namespace import CacheDecision
from cache.types import Lookup
from engine.errors import PromptTooLongError
from gateway.adapters import SEPARATOR as ADAPTER_SEPARATOR
from gateway.adapters import ResolvedModel
from gateway.answer_reuse import AnswerReuse
from gateway.auth import KeyStore, Principal
from gateway.budget_webhook import BudgetWebhook
from gateway.backends import BackendUnavailable, GenerationChunk, GenerationRequest, ModelBackend
from gateway.deployed import DEFAULT_MAX_MODEL_LEN, DeployedModels
from gateway.drain import EndedByShutdown, InFlight, ended_by_shutdown
from gateway.embedding_format import EmbeddingFormat
from gateway.errors import (APIError, context_length_exceeded, invalid_request, model_not_found, server_error,
                            unavailable)
from gateway.limits import Limiter
from gateway.metrics import Metrics
from gateway.openai_format import DONE, ChatFormat, ChoiceText, CompletionFormat, sse, usage
from gateway.prompt_tokens import PromptTokenCounter
from gateway.router import RouteDecision
from gateway.sampling import value_error
from gateway.specs import DEFAULT_TOOL_PARSER, ModelKind

log = logging.getLogger("tollgate.gateway")

Format = ChatFormat | CompletionFormat | EmbeddingFormat
_SERVED_BY = {"chat": "/v1/chat/completions and /v1/completions", "embedding": "/v1/embeddings"}


@dataclass
class Call:
    """One admitted request: who, which model, and what it has used so far."""

    request_id: str
    principal: Principal
    model: str
    backend: ModelBackend
    fmt: Format
    end_user: str | None
    tags: list[str]
    # the deployed model and LoRA adapter behind `model` (which is what the client asked for: model or model:adapter)
    resolved: ResolvedModel | None = None
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    queue_s: float | None = None
    route: str | None = None  # the router's task, when the client asked for model "auto"
    cache_hit: bool = False
    # set when the answer may be stored in the semantic cache once it completes
    cache_decision: CacheDecision | None = None
    cache_learning: Lookup | None = None  # a lookup near an entry's threshold: this answer labels that entry
    answer_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None  # of choice 0, kept with a cached answer
    reserved: bool = False  # admission reserved its worst case (billing/reservations.py)
    hold_shrunk: bool = False

    def absorb(self, chunk: GenerationChunk) -> None:
        self.prompt_tokens = chunk.prompt_tokens
        self.cached_tokens = chunk.cached_tokens
        self.completion_tokens = chunk.completion_tokens
        if self.ttft_s is None and chunk.ttft_s is not None:
            self.ttft_s = chunk.ttft_s
        if self.queue_s is None and chunk.queue_s is not None:
            self.queue_s = chunk.queue_s
        if self.cache_decision is not None:
            for c in chunk.choices:
                if c.index == 0:
                    self.answer_parts.append(c.text)
                    self.finish_reason = c.finish_reason or self.finish_reason

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _adapter_name(resolved: ResolvedModel | None) -> str | None:
    return resolved.adapter.name if resolved is not None and resolved.adapter is not None else None


def _with_usage(events: list[dict[str, Any]], chunk: GenerationChunk | None,
                completion_tokens: int) -> list[dict[str, Any]]:
    if chunk is not None:
        for event in events:
            event["usage"] = usage(chunk.prompt_tokens, completion_tokens, chunk.cached_tokens)
    return events


def _recorded(err: APIError) -> APIError:
    err.recorded = True
    return err


def short_timeout_engine(db: Engine, timeout_s: float) -> Engine:
    """Another engine on db's database whose statements give up after about timeout_s (an in-memory
    SQLite database cannot be opened twice: db itself then)."""
    url = db.url.render_as_string(hide_password=False)
    if db.dialect.name == "sqlite" and db.url.database in (None, "", ":memory:"):
        return db
    return make_engine(url, busy_timeout_s=timeout_s)


class Gateway:
    def __init__(self, db: Engine, models: DeployedModels, *, key_cache_ttl_s: float = 1.0,
                 ledger_max_batch: int = 1000, reuse: AnswerReuse | None = None, ledger_spill_dir: Path | None = None,
                 ledger_max_buffer: int = 10_000, admission_db_timeout_s: float | None = None,
                 budget_alert_webhook: str | None = None, budget_leases: bool = False) -> None:
        self.db = db
        self.models = models  # replaced whole when deployments change (gateway/deployed.py)
        self.models_dir: Path = Path.cwd()  # the spec directory (settings.models_dir): adapters may load from it
        self.refused_specs: list[str] = []  # spec files of that directory that could not be read (/health)
        self.reuse = reuse or AnswerReuse(None)
        # key lookups and limits read the database on the request path: with it unreachable they give up
        # after admission_db_timeout_s (then fail open, see limits.py), not after the ledger's long wait
        admission_db = db if admission_db_timeout_s is None else short_timeout_engine(db, admission_db_timeout_s)
        self.keys = KeyStore(admission_db, ttl_s=key_cache_ttl_s)
        self.budget_webhook = BudgetWebhook(budget_alert_webhook) if budget_alert_webhook else None
        self.ledger = Ledger(db, max_batch=ledger_max_batch, spill_dir=ledger_spill_dir, max_buffer=ledger_max_buffer,
                             on_alert=self.budget_webhook)
        self.limiter = Limiter(admission_db, self.ledger, leases=budget_leases)
        self.prompt_tokens = PromptTokenCounter()  # admission holds a prompt's real tokens
        self.in_flight = InFlight()  # the API requests running; a stop drains them (gateway/drain.py)
        # this process's heartbeat: while it beats, no other gateway releases its reservations
        self.keeper = ReservationKeeper(admission_db, self.limiter.owner, also=self.limiter.retry_releases)
        self.metrics = Metrics(self._engine_stats, lambda: self.ledger.backlog)
        self.metrics.watch_budgets(db)
        self.metrics.watch_gpu_idle(db)
        self.metrics.watch_replicas(lambda: {name: b.info().replica_states or {} for name, b in self.backends.items()})

    @property
    def backends(self) -> dict[str, ModelBackend]:
        return self.models.backends

    def _engine_stats(self) -> dict[str, dict[str, Any]]:
        return {name: b.stats() for name, b in self.backends.items() if hasattr(b, "stats")}

    # ---- admission --------------------------------------------------------------------------

    def backend_for(self, model: str, kind: ModelKind = "chat") -> ModelBackend:
        """The model's backend: 404 unknown, 400 naming `model` when it is not of this endpoint's kind, 503 when it
        cannot serve now."""
        backend = self.backends.get(model)
        if backend is None:
            raise model_not_found(model)
        info = backend.info()
        if info.kind != kind:
            raise invalid_request(f"model: `{model}` is {'an' if info.kind == 'embedding' else 'a'} {info.kind} model, "
                                  f"served by {_SERVED_BY[info.kind]} only", "model", "model_not_supported")
        if not info.serving:
            why = f": {info.reason}" if info.reason else "; try again shortly."
            raise unavailable(f"The model `{model}` is {info.state}{why}")
        return backend

    def route(self, messages: list[dict[str, Any]], max_tokens: int | None) -> RouteDecision:
        return self.reuse.route(messages, max_tokens, self.models.route_candidates())

    def needs_admission(self, p: Principal) -> bool:
        return p.scoped_budgets or any(v is not None for v in (p.rpm, p.tpm, p.key_budget_usd, p.tenant_budget_usd))

    def worst_case(self, model: str | ResolvedModel, backend: ModelBackend, prompt_tokens_bound: int, max_tokens: int | None,
                   n: int, prompt_counted: bool = False) -> Worst:
        """What a request may cost at most: its prompt's tokens (counted with the model's tokenizer, else bounded by its
        UTF-8 bytes) and max_tokens × n at the model's prices; without max_tokens, the whole context for each choice."""
        per_choice = max_tokens if max_tokens is not None else (backend.info().max_model_len or DEFAULT_MAX_MODEL_LEN)
        completion = per_choice * n
        cost = request_cost(self.models.prices(model), prompt_tokens_bound, completion)
        return Worst(cost, prompt_tokens_bound + completion, prompt_tokens_bound, prompt_counted)

    def tool_parser(self, model: str) -> str:
        """The model's tool-call format (its spec's tool_parser; an adapter's base model's)."""
        spec = self.models.specs.get(model.partition(ADAPTER_SEPARATOR)[0])
        return spec.tool_parser if spec is not None else DEFAULT_TOOL_PARSER

    def cache_salt(self, p: Principal, model: str) -> str | None:
        """Whose prefix-cache blocks this request may reuse (the model spec's prefix_sharing; tenant by default)."""
        spec = self.models.specs.get(model)
        sharing = spec.prefix_sharing if spec is not None else "tenant"
        return {"tenant": f"tenant:{p.tenant_uid}", "key": f"key:{p.tenant_uid}:{p.key_id}", "all": None}[sharing]

    @staticmethod
    def new_request_id(fmt: Format) -> str:
        return f"{fmt.id_prefix}{uuid.uuid4().hex}"

    @staticmethod
    def tags_of(p: Principal, request_tags: list[str]) -> list[str]:
        """A request's tags: its key's project, then the request's metadata.tags."""
        return ([p.project] if p.project else []) + request_tags

    def new_call(self, request_id: str, p: Principal, model: str, backend: ModelBackend, fmt: Format,
                 end_user: str | None, request_tags: list[str], resolved: ResolvedModel | None = None) -> Call:
        """The admitted request, journaled before anything runs (billing/admission_journal.py): it leaves a
        usage event whatever happens to this process. A 503 when the journal cannot be written."""
        tags = self.tags_of(p, request_tags)
        try:
            self.ledger.begin(request_id, tenant_id=p.tenant_id, api_key_id=p.key_id,
                              model=resolved.base if resolved else model, endpoint=fmt.endpoint, end_user=end_user,
                              tags=tags, adapter=_adapter_name(resolved))
        except OSError as e:
            log.error("cannot journal request %s: %s", request_id, e)
            raise APIError(503, "The gateway cannot record requests right now (its journal is not writable); "
                           "try again shortly.", "server_error", "journal_unavailable") from e
        return Call(request_id, p, model, backend, fmt, end_user, tags, resolved)

    def refused(self, call: Call) -> None:
        """A journaled request that was refused before it ran, leaving no usage event."""
        self.ledger.refused(call.request_id)

    # ---- the model call ---------------------------------------------------------------------

    async def begin(self, call: Call, request: GenerationRequest) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        """Start generating and wait for the first chunk, so that bad input is a 4xx, not a broken stream."""
        stream = call.backend.generate(request)
        try:
            first = await stream.__anext__()
        except PromptTooLongError as e:
            raise context_length_exceeded(str(e), "max_tokens" if e.max_tokens is not None else "messages") from e
        except ValueError as e:
            raise value_error(e) from e
        except BackendUnavailable as e:
            raise unavailable(str(e)) from e
        except StopAsyncIteration as e:
            self.record(call, "failed", "no output")
            raise _recorded(server_error()) from e
        except Exception as e:
            log.exception("model %s failed before its first output", call.model)
            self.record(call, "failed", type(e).__name__)
            raise _recorded(server_error()) from e
        call.prompt_tokens, call.cached_tokens = first.prompt_tokens, first.cached_tokens
        return first, stream

    async def whole(self, call: Call, first: GenerationChunk, stream: AsyncIterator[GenerationChunk],
                    n: int, keep_best: int | None = None) -> dict[str, Any]:
        """The whole response of n choices; `keep_best`: only that many, those whose tokens have the highest summed
        logprob (best_of), renumbered from 0."""
        choices = [ChoiceText() for _ in range(n)]
        status, error = "cancelled", None
        try:
            chunk = first
            while True:
                call.absorb(chunk)
                for c in chunk.choices:
                    choices[c.index].text.append(c.text)
                    if c.logprobs:
                        choices[c.index].logprobs.extend(c.logprobs)
                    if c.finish_reason is not None:
                        choices[c.index].finish_reason = c.finish_reason
                if chunk.finished:
                    break
                chunk = await self.in_flight.next_chunk(stream)
            status = "ok"
        except EndedByShutdown as e:  # the drain window ran out: a 503 to retry, billed for what it generated
            status, error = "cancelled", "shutdown"
            raise ended_by_shutdown(self.in_flight.drain_s) from e
        except BackendUnavailable as e:  # its replica was lost: nothing was sent yet, so a 503 to retry
            status, error = "failed", type(e).__name__
            log.warning("model %s: %s", call.model, e)
            raise unavailable(str(e)) from e
        except Exception as e:
            status, error = "failed", type(e).__name__
            log.exception("model %s failed mid-request", call.model)
            raise server_error() from e
        finally:
            await self._finish(call, stream, status, error)
        if keep_best is not None:
            choices = sorted(choices, key=lambda c: -sum(t.logprob for t in c.logprobs))[:keep_best]
        return call.fmt.response(call.request_id, call.created, call.model, choices, call.usage())

    async def streamed(self, call: Call, first: GenerationChunk, stream: AsyncIterator[GenerationChunk], n: int,
                       include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
        """SSE events; `continuous_usage` (vLLM's continuous_usage_stats): every chunk carries the usage so far."""
        fmt, rid, created, model = call.fmt, call.request_id, call.created, call.model
        status, error = "cancelled", None
        try:
            opening = b"".join(sse(obj) for obj in _with_usage(fmt.opening(rid, created, model, n),
                                                               first if continuous_usage else None, 0))
            chunk = first
            itl = self.metrics.itl.labels(model)
            last_sent: float | None = None
            while True:
                if continuous_usage:
                    events = b"".join(sse(obj) for obj in _with_usage(
                        [fmt.delta(rid, created, model, c) for c in chunk.choices], chunk, chunk.completion_tokens))
                else:
                    events = b"".join(fmt.delta_event(rid, created, model, c) for c in chunk.choices)
                if opening:  # the role chunk goes out with the first tokens: one write, not two
                    events, opening = opening + events, b""
                if events:
                    yield events
                call.absorb(chunk)  # counted once the client has been handed the tokens
                tokens = sum(c.num_tokens for c in chunk.choices)
                if tokens:
                    now = time.perf_counter()
                    if last_sent is not None:
                        for _ in range(tokens):
                            itl.observe((now - last_sent) / tokens)
                    last_sent = now
                if chunk.finished:
                    break
                chunk = await self.in_flight.next_chunk(stream)
            await self.shrink_hold(call)  # before the stream ends: a next request sees this one's real cost
            if include_usage:
                yield sse(fmt.usage_chunk(rid, created, model, call.usage()))
            status = "ok"
            yield DONE
        except EndedByShutdown:  # the drain window ran out: the stream ends with an error event, billed as sent
            status, error = "cancelled", "shutdown"
            if include_usage:  # what it is billed for: the tokens it was sent
                yield sse(fmt.usage_chunk(rid, created, model, call.usage()))
            yield sse(ended_by_shutdown(self.in_flight.drain_s).body())
            yield DONE
        except BackendUnavailable as e:  # its replica was lost mid-stream: the error event says to retry
            status, error = "failed", type(e).__name__
            log.warning("model %s: %s", model, e)
            if include_usage:
                yield sse(fmt.usage_chunk(rid, created, model, call.usage()))
            yield sse(unavailable(str(e)).body())
            yield DONE
        except Exception as e:
            status, error = "failed", type(e).__name__
            log.exception("model %s failed mid-stream", model)
            yield sse(server_error().body())
            yield DONE
        finally:
            await self._finish(call, stream, status, error)

    async def _finish(self, call: Call, stream: AsyncIterator[GenerationChunk], status: str,
                      error: str | None) -> None:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # type: ignore[attr-defined]
            if status != "ok" and not call.cache_hit:
                await call.backend.abort(call.request_id)
            await self.shrink_hold(call)
            self.record(call, status, error)
            if status == "ok" and call.cache_decision is not None and not call.cache_hit:
                self.reuse.store_later(call.cache_decision, "".join(call.answer_parts), {
                    "prompt_tokens": call.prompt_tokens, "completion_tokens": call.completion_tokens,
                    "cost_usd": float(self._list_price(call)), "finish_reason": call.finish_reason or "stop"},
                    call.cache_learning)

    # ---- the ledger -------------------------------------------------------------------------

    async def shrink_hold(self, call: Call) -> None:
        """The request is done: its reservation becomes its exact cost now, before the response completes, rather
        than when the ledger writes its event (a request sent right after would meet its worst case still held)."""
        if not call.reserved or call.hold_shrunk:
            return
        call.hold_shrunk = True
        cost = ZERO if call.cache_hit else self._list_price(call)
        with anyio.CancelScope(shield=True):  # done before record(): the ledger then settles the shrunk hold
            await self.limiter.shrink_async(call.request_id, cost, call.prompt_tokens + call.completion_tokens)

    def _list_price(self, call: Call) -> Decimal:
        return request_cost(self.models.prices(call.resolved or call.model), call.prompt_tokens, call.completion_tokens,
                            call.cached_tokens)

    def record(self, call: Call, status: str, error: str | None = None) -> None:
        latency = time.perf_counter() - call.started
        # a cache hit is billed at the cache price (0); its tokens are what it saved at the list price
        cost = ZERO if call.cache_hit else self._list_price(call)
        p = call.principal
        prices = stored_prices(self.models.prices(call.resolved or call.model))  # kept with it: never re-priced
        self.ledger.record_row(dict(
            request_id=call.request_id, tenant_id=p.tenant_id, api_key_id=p.key_id, end_user=call.end_user,
            tags=call.tags, model=call.resolved.base if call.resolved else call.model,
            adapter=_adapter_name(call.resolved), endpoint=call.fmt.endpoint, route=call.route, status=status,
            prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens,
            cached_tokens=call.cached_tokens, cache_hit=call.cache_hit, latency_s=latency, ttft_s=call.ttft_s,
            cost_usd=cost, error=error, **prices,
        ))
        m = self.metrics
        m.add_spend(p.tenant, cost)
        if call.cache_hit:
            m.cache_hit(call.model, self._list_price(call))
        m.request_done(call.model, call.fmt.endpoint, status, call.prompt_tokens, call.completion_tokens, cost,
                       latency, call.ttft_s, call.queue_s, tpot=not call.cache_hit)

    def rejected(self, err: APIError) -> None:
        self.metrics.rejected.labels(str(err.status), err.code or "").inc()
