"""POST /v1/embeddings: an embedding model's vectors behind the same keys, limits and budgets as completions.

The way through: the body is checked (gateway/protocol.py); the model must be an embedding model (400 naming
`model` otherwise); its backend tokenizes the inputs and refuses bad ones (too long, unknown token ids, a
`dimensions` the model does not give; token ids and `dimensions` are checked first from the model's config files
here, so a bad one never wakes a model scaled to zero) — all before anything is reserved or journaled; then admission reserves
the exact cost (input tokens at the model's input price), the request is journaled, the inputs are embedded in
passes shared with concurrent requests, and one usage event (endpoint `embeddings`) records the tokens."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import anyio
from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from billing.pricing import request_cost
from billing.reservations import Worst
from gateway.answer_reuse import AUTO_MODEL
from gateway.auth import Principal
from gateway.backends import BackendUnavailable
from gateway.embedding_backend import EmbeddingBackend, EmbedRequest
from gateway.embedding_format import EMBEDDINGS, embedding_response
from gateway.errors import APIError, invalid_request, server_error, unavailable
from gateway.protocol import EmbeddingRequest
from gateway.routes import gateway, principal
from gateway.sampling import value_error
from gateway.service import Call, Gateway

log = logging.getLogger("tollgate.gateway")

embeddings_router = APIRouter()


@embeddings_router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, p: Principal = Depends(principal),
                            gw: Gateway = Depends(gateway)) -> Response:
    try:
        backend, token_ids = await _checked(gw, body)
    except APIError as e:
        gw.rejected(e)
        raise
    tokens = sum(len(row) for row in token_ids)
    request_id = gw.new_request_id(EMBEDDINGS)
    headers = {"X-Request-Id": request_id}
    call = await _admitted(gw, p, body, backend, request_id, tokens, headers)
    call.prompt_tokens = tokens
    try:
        vectors = await backend.embed(EmbedRequest(request_id, token_ids, body.dimensions, p.tenant_uid))
    except asyncio.CancelledError:
        gw.record(call, "cancelled")  # the inputs were admitted and may be in a pass already: billed as sent
        raise
    except BackendUnavailable as e:  # the replica went away between the two calls
        call.prompt_tokens = 0
        gw.record(call, "failed", type(e).__name__)
        raise unavailable(str(e)) from e
    except ValueError as e:  # a replica of another version of the model refused what this one's tokenizer gave
        call.prompt_tokens = 0
        gw.record(call, "failed", type(e).__name__)
        raise value_error(e) from e
    except Exception as e:
        log.exception("model %s failed to embed", body.model)
        call.prompt_tokens = 0
        gw.record(call, "failed", type(e).__name__)
        raise server_error() from e
    gw.record(call, "ok")
    # a full request is 2048 x 384 floats: rendered off the event loop, where the streams of others run
    return await run_in_threadpool(
        lambda: JSONResponse(embedding_response(body.model, vectors, body.encoding_format, tokens), headers=headers))


async def _checked(gw: Gateway, body: EmbeddingRequest) -> tuple[EmbeddingBackend, list[list[int]]]:
    """The model's backend and the inputs' token ids; a 4xx for anything wrong with the request."""
    if body.model == AUTO_MODEL:
        raise invalid_request("model: name an embedding model; \"auto\" routes chat requests only (vectors of "
                              "different models cannot be compared)", "model", "model_not_supported")
    backend = cast(EmbeddingBackend, gw.backend_for(body.model, kind="embedding"))
    try:  # what its config can tell is refused here, before a model scaled to zero wakes for it
        await gw.prompt_tokens.check_embedding_inputs(gw.models.specs.get(body.model), body.inputs(), body.dimensions)
        return backend, await backend.tokenize(body.inputs(), body.dimensions)
    except ValueError as e:
        raise value_error(e) from e
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e


async def _admitted(gw: Gateway, p: Principal, body: EmbeddingRequest, backend: EmbeddingBackend,
                    request_id: str, tokens: int, headers: dict[str, str]) -> Call:
    """Reserve the request's cost (exact: it has no output) against the key's and tenant's limits and budgets,
    then journal it; nothing is left held when either refuses."""
    reserved = False
    try:
        if gw.needs_admission(p):
            worst = Worst(request_cost(gw.models.prices(body.model), tokens, 0), tokens)
            limits = await gw.limiter.admit_async(p, request_id, worst, model=body.model,
                                                  endpoint=EMBEDDINGS.endpoint, end_user=body.user,
                                                  tags=gw.tags_of(p, []))
            reserved = True
            if limits is not None:
                headers.update(limits.headers())
        return gw.new_call(request_id, p, body.model, backend, EMBEDDINGS, body.user, [])  # type: ignore[arg-type]
    except BaseException as e:
        if reserved:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(gw.limiter.release, request_id)
        if isinstance(e, APIError):
            gw.rejected(e)
        raise
