"""POST /v1/cache/feedback: a client flags a cached answer it was served as wrong; the entry that served it stops
serving questions that far from it (or at all, when the question was the same text) at once."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.auth import Principal
from gateway.errors import APIError
from gateway.protocol import CacheFeedbackRequest
from gateway.routes import gateway, principal
from gateway.service import Gateway

cache_feedback_router = APIRouter()


@cache_feedback_router.post("/v1/cache/feedback")
async def cache_feedback(body: CacheFeedbackRequest, p: Principal = Depends(principal),
                         gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    flagged = await gw.reuse.flag(p.tenant_uid, body.response_id)
    if flagged is None:  # another tenant's response id reads exactly like an unknown one
        raise APIError(404, f"No cached answer was served to you as {body.response_id!r} (only answers served from "
                       "the semantic cache, marked x-tollgate-cache: hit, can be flagged).", "invalid_request_error",
                       "response_not_found", "response_id")
    return {"object": "cache.feedback", "response_id": flagged.response_id, "flagged": True,
            "score": round(flagged.score, 6), "entry_removed": flagged.removed,
            "entry_threshold": None if flagged.threshold is None else round(flagged.threshold, 6)}
