"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.recorded = False  # a usage event was recorded for the request (it settles the reservation)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400; its code is "invalid_value" where a field is named and no other code is given."""
    return APIError(400, message, "invalid_request_error", code or ("invalid_value" if param else None), param)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", "invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", "model_not_found", "model")


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, "invalid_request_error", "context_length_exceeded", param)


def rate_limited(message: str, retry_after: int, limit: str = "requests") -> APIError:
    """A 429 for a requests or tokens limit (OpenAI's error type names which)."""
    return APIError(429, message, limit, "rate_limit_exceeded", None, {"Retry-After": str(retry_after)})


def insufficient_quota(message: str) -> APIError:
    return APIError(429, message, "insufficient_quota", "insufficient_quota")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", "invalid_request_error",
                    "request_too_large")


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read, so that FastAPI passes it through to our handler."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than {limit} bytes.")
        self.limit = limit


def server_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, "server_error", "internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", "model_unavailable")


def database_unavailable(retry_after: int = 5) -> APIError:
    return APIError(503, "The key database is unreachable, so this key cannot be checked; try again shortly.",
                    "server_error", "service_unavailable", None, {"Retry-After": str(retry_after)})


UNRECOGNIZED = "unrecognized request argument; this server does not support it"


def invalid_body(errors: Sequence[Any]) -> APIError:
    """The 400 for a body that failed validation (pydantic's or FastAPI's errors: a location may start with "body")."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return invalid_json()
    if first.get("type") == "extra_forbidden" and loc:
        param = ".".join(loc)
        return invalid_request(f"{param}: {UNRECOGNIZED}", param, "unknown_parameter")
    msg = str(first.get("msg", "Invalid request body")).removeprefix("Value error, ")
    head, sep, rest = msg.partition(": ")
    if sep and head and " " not in head:  # our validators say "field.path: problem"
        loc, msg = (loc if loc[-1:] == [head] else [*loc, head]), rest
    param = ".".join(loc) or None
    code = "unknown_parameter" if msg == UNRECOGNIZED else "invalid_value" if loc else "invalid_body"
    if loc:
        msg = f"{param}: {msg}"
    return invalid_request(msg, param, code)


def invalid_json() -> APIError:
    return invalid_request("We could not parse the JSON body of your request. (HINT: This likely means you "
                           "aren't using your HTTP library correctly.)", None, "invalid_json")


def install(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return invalid_body(exc.errors()).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc, BodyTooLarge):
            return body_too_large(exc.limit).response()
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind, None).response()

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette's last resort (ServerErrorMiddleware) would answer a plain-text "Internal Server Error"; it
        # still re-raises the exception after this response, so the server logs it with its traceback
        return server_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


def sse_error(err: APIError) -> bytes:
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
