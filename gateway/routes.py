"""The OpenAI-compatible endpoints."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from billing.admin_keys import check_admin_key
from engine.structured_outputs import StructuredOutputs
from gateway.answer_reuse import AUTO_MODEL, CacheOutcome, hit_stream
from gateway.auth import Principal
from gateway.auth_throttle import client_address
from gateway.backends import GenerationRequest
from gateway.errors import APIError, invalid_body, invalid_json, invalid_request, model_not_found
from gateway.metrics import CONTENT_TYPE
from gateway.openai_format import ChatFormat, CompletionFormat
from gateway.prompt_length import refuse_overlong
from gateway.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from gateway.router import RouteDecision
from gateway.sampling import check_structured_outputs, to_sampling_params, value_error
from gateway.service import Call, Gateway
from gateway.sse import EventStreamResponse
from gateway.tool_calls.plan import tool_plan, tools_prompt_bytes

router = APIRouter()
Body = TypeVar("Body", bound=BaseModel)


async def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def principal(request: Request) -> Principal:
    gw: Gateway = request.app.state.gateway
    header = request.headers.get("authorization")
    found = gw.keys.cached(header)
    if found is not None:
        return found
    try:  # a cache miss reads the database in a worker thread, off the event loop
        return await run_in_threadpool(gw.keys.authenticate, header)
    except APIError as e:
        refusal = request.app.state.auth_throttle.throttled(e, client_address(request)) if e.status == 401 else e
        gw.rejected(refusal)
        raise refusal from None


@router.get("/health", response_model=None)
async def health(gw: Gateway = Depends(gateway)) -> dict[str, Any] | JSONResponse:
    """200 ok (every model serving) or degraded (some cannot, or a spec file could not be read); 503 draining once
    a stop began, so that a load balancer sends new requests elsewhere while this gateway finishes its streams."""
    infos = {name: b.info() for name, b in gw.backends.items()}
    models = {name: info.state for name, info in infos.items()}
    if gw.in_flight.draining:
        return JSONResponse({"status": "draining", "models": models}, status_code=503)
    ok = all(info.serving for info in infos.values()) and not gw.refused_specs
    body: dict[str, Any] = {"status": "ok" if ok else "degraded", "models": models}
    if gw.refused_specs:  # file names only: why each was refused is in the server's log, not for any caller
        body["refused_specs"] = gw.refused_specs
    return body


@router.get("/metrics")
async def metrics(request: Request, gw: Gateway = Depends(gateway)) -> Response:
    """Only for a scrape with an admin key: tenants reach this port too, and every series here (requests,
    tokens, latencies, cache hits, per-tenant spend) moves with other tenants' traffic."""
    if not await _is_admin(request, gw):
        raise APIError(401, "/metrics needs an admin key (`platform admin create-key`) as Authorization: Bearer; "
                       "its series move with every tenant's traffic.", "invalid_request_error", "invalid_api_key")
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


async def _is_admin(request: Request, gw: Gateway) -> bool:
    header = request.headers.get("authorization") or ""
    given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
    if not given:
        return False
    try:
        return await run_in_threadpool(check_admin_key, gw.db, given, request.app.state.admin_key) is not None
    except SQLAlchemyError:  # the database is down: the scrape still gets the series anyone may see
        return False


def visible_models(p: Principal, gw: Gateway) -> list[dict[str, Any]]:
    """The deployed models, and the LoRA adapters this tenant may use (`model:adapter`, `parent` its model)."""
    data = []
    for name, backend in gw.backends.items():
        info = backend.info()
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "tollgate", "kind": info.kind,
                 "max_model_len": info.max_model_len, "state": info.state}
        if info.reason:
            entry["reason"] = info.reason
        data.append(entry)
    for adapter in gw.models.adapters.visible(p.tenant):
        base = gw.backends.get(adapter.model)
        info = base.info() if base is not None else None
        data.append({"id": adapter.id, "object": "model", "created": 0, "owned_by": "tollgate", "kind": "chat",
                     "parent": adapter.model, "max_model_len": info.max_model_len if info else None,
                     "state": info.state if info else "unavailable"})
    return data


@router.get("/v1/models")
async def list_models(p: Principal = Depends(principal), gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    return {"object": "list", "data": visible_models(p, gw)}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, p: Principal = Depends(principal),
                         gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    """One entry of /v1/models (OpenAI's retrieve); 404 model_not_found for any other id, adapters this tenant may
    not use among them."""
    found = next((m for m in visible_models(p, gw) if m["id"] == model), None)
    if found is None:
        raise model_not_found(model)
    return found


@contextlib.contextmanager
def counted_refusals(gw: Gateway) -> Iterator[None]:
    """A request refused before it reaches _run (its body, its tools) counts in tollgate_rejected_requests as the
    refusals after it do."""
    try:
        yield
    except APIError as e:
        gw.rejected(e)
        raise


async def parsed_body(request: Request, model: type[Body]) -> Body:
    """The body as `model`, checked as FastAPI checks a body parameter (JSON decoded, then validated strictly)."""
    raw = await request.body()
    if not raw:
        raise invalid_request("The request body is empty: send a JSON object.", None, "invalid_body")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise invalid_json() from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_body(e.errors(include_url=False)) from None


async def chat_completions(request: Request) -> Response:
    p = await principal(request)
    gw: Gateway = request.app.state.gateway
    with counted_refusals(gw):
        body = await parsed_body(request, ChatCompletionRequest)
        messages = [m.template_message() for m in body.messages]
        model, route = body.model, None
        if model == AUTO_MODEL:
            decision = gw.route(messages, body.max_completion_tokens or body.max_tokens)
            model, route = decision.model, decision
        tools = await tool_plan(body, gw.tool_parser(model))
    fmt = ChatFormat(body.logprobs, tools.new_parser if tools is not None else None)
    cache_view = {**body.model_dump(exclude_none=True), "model": model, "messages": messages}
    return await _run(gw, p, body, fmt, lambda rid, params: GenerationRequest(
        rid, params, messages=messages, tools=tools.tools or None if tools is not None else None),
        prompt_tokens_bound=chat_prompt_bound(messages) + tools_prompt_bytes(tools), model=model, route=route,
        cache_view=cache_view, tool_constraint=tools.constraint if tools is not None else None,
        prompt_length={"chars": sum(len(m.get("content") or "") for m in messages), "field": "messages"})


# A bound on a prompt's tokens before it is tokenized: a byte-level or byte-fallback tokenizer makes no more
# tokens than the text has UTF-8 bytes (one more for a leading word marker); the chat template adds a few
# tokens a message and a default system prompt.
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS = 64


def chat_prompt_bound(messages: list[dict[str, Any]]) -> int:
    """Tool calls and results count as the JSON the templates write of them (escaped, so longer than the text)."""
    return sum((len(m["content"].encode()) + len(m.get("name", "").encode()) if set(m) <= {"role", "content", "name"}
                else len(json.dumps(m).encode())) + TEMPLATE_TOKENS_PER_MESSAGE for m in messages) + TEMPLATE_TOKENS


def completion_prompt_bound(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 2


async def completions(request: Request) -> Response:
    p = await principal(request)
    gw: Gateway = request.app.state.gateway
    with counted_refusals(gw):
        body = await parsed_body(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid_request("prompt: batches of several prompts are not supported; send one per request",
                                      "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt or prompt == "":
            raise invalid_request("prompt: must not be empty", "prompt")
    fmt = CompletionFormat(body.logprobs is not None)
    length = {"token_ids": len(prompt)} if isinstance(prompt, list) else {"chars": len(prompt)}
    return await _run(gw, p, body, fmt, lambda rid, params: GenerationRequest(rid, params, prompt=prompt),
                      prompt_tokens_bound=completion_prompt_bound(prompt), prompt_length={**length, "field": "prompt"})


async def _run(gw: Gateway, p: Principal, body: ChatCompletionRequest | CompletionRequest,
               fmt: ChatFormat | CompletionFormat, make_request: Any, *, prompt_tokens_bound: int,
               model: str | None = None, route: RouteDecision | None = None,
               cache_view: dict[str, Any] | None = None, tool_constraint: StructuredOutputs | None = None,
               prompt_length: dict[str, Any] | None = None) -> Response:
    """`model`: the deployed model to call (the router's choice for "auto"); `cache_view`: the request as
    the semantic cache sees it (chat only); `prompt_tokens_bound`: at least the prompt's tokens, held where the model's
    tokenizer cannot be had here (gateway/prompt_tokens.py); `prompt_length`:
    the prompt's length for the cheap refusal of one too long (gateway/prompt_length.py)."""
    model = model or body.model
    headers = {}
    request_id = gw.new_request_id(fmt)
    reserved = False
    call: Call | None = None
    try:
        params = to_sampling_params(body, tool_constraint)
        await check_structured_outputs(params)
        resolved = gw.models.adapters.resolve(model, p.tenant)  # an adapter runs on its model's backend, and size
        backend = gw.backend_for(resolved.base)
        # too long by its length alone: refused before it is tokenized or anything is reserved
        refuse_overlong(model, backend.info(), **(prompt_length or {}))
        generation = make_request(request_id, params)
        try:  # a token id outside the vocabulary is refused here, before a model scaled to zero wakes for it
            await gw.prompt_tokens.check_token_ids(gw.models.specs.get(resolved.base), generation)
        except ValueError as e:
            raise value_error(e) from e
        if gw.needs_admission(p):
            tags = gw.tags_of(p, body.tags())
            # from a budget lease, the prompt held at its byte bound (the lease has room to spare; the hold shrinks to
            # the real tokens when the request ends); else reserved with the prompt's tokens counted
            limits = gw.limiter.admit_from_lease(
                p, request_id, gw.worst_case(resolved, backend, prompt_tokens_bound, params.max_tokens, params.n),
                end_user=body.end_user(), tags=tags)
            if limits is False:
                try:  # the prompt's real tokens where this process has the model's tokenizer, else the byte bound
                    counted = await gw.prompt_tokens.count(gw.models.specs.get(resolved.base), generation)
                except ValueError as e:
                    raise value_error(e) from e
                prompt_tokens = counted if counted is not None else prompt_tokens_bound
                worst = gw.worst_case(resolved, backend, prompt_tokens, params.max_tokens, params.n,
                                      prompt_counted=counted is not None)
                limits = await gw.limiter.admit_async(p, request_id, worst, model=model, endpoint=fmt.endpoint,
                                                      end_user=body.end_user(), tags=tags)
            reserved = True
            if limits is not None:
                headers.update(limits.headers())
        call = gw.new_call(request_id, p, model, backend, fmt, body.end_user(), body.tags(), resolved)
        call.reserved = reserved
        if route is not None:
            call.route = route.task
            headers["x-tollgate-route"] = route.header
        # the cache namespace holds the model as asked, with an adapter's weights: its answers never serve its base,
        # another adapter, or other weights later served under its name
        outcome = CacheOutcome(None) if cache_view is None else await gw.reuse.lookup(
            p.tenant_uid, resolved.cache_model(), cache_view, p.cache_max_false_hit_rate)
        if outcome.decision is not None:
            headers.update(outcome.headers())
        if outcome.hit is not None:
            call.cache_hit = True
            await gw.reuse.note_served(call.request_id, outcome)
            stream = hit_stream(call.request_id, outcome.hit)
            first = await stream.__anext__()
        else:
            if outcome.decision is not None and outcome.decision.cacheable:
                call.cache_decision = outcome.decision
                # an answer labels the nearest entry only where both answers are the model's one answer
                greedy = float(outcome.decision.settings.get("temperature", 1.0)) == 0.0
                call.cache_learning = outcome.lookup if outcome.learning and greedy else None
            generation.cache_salt = gw.cache_salt(p, resolved.base)
            generation.account = p.tenant_uid
            if resolved.adapter is not None:
                generation.lora_name, generation.lora_path = resolved.adapter.name, resolved.adapter.source
            first, stream = await gw.begin(call, generation)
    except BaseException as e:
        # refused (or cancelled) after admission and before the model ran: no usage event follows, so the
        # reservation goes back now; a failure that recorded one settles when the ledger writes it
        if not getattr(e, "recorded", False):
            if call is not None:
                gw.refused(call)
            if reserved:
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(gw.limiter.release, request_id)
        if isinstance(e, APIError):
            gw.rejected(e)
        raise
    headers["X-Request-Id"] = call.request_id
    if body.stream:
        options = body.stream_options or StreamOptions()
        return EventStreamResponse(gw.streamed(call, first, stream, body.n, options.include_usage,
                                               continuous_usage=options.continuous_usage_stats), headers=headers)
    # best_of: params.n candidates ran, the best body.n are returned
    result = await gw.whole(call, first, stream, params.n, keep_best=body.n if params.n > body.n else None)
    return JSONResponse(result, headers=headers)


# The completion endpoints are plain Starlette endpoints (they read and check their own body): the app registers
# them as routes and reaches them past FastAPI's router as well (gateway/direct_routes.py).
COMPLETION_ROUTES = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
