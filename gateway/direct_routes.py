"""ASGI middleware: the completion endpoints reached by method and path before FastAPI's router.

FastAPI's routing, dependency solving and exception middleware cost about as much per request as all the gateway's
own work (auth, limits, the ledger, metrics); the hot endpoints skip them. They stay registered with the app as well,
so that every other method or path variant is answered by the app as before (405, a redirect, 404)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, BodyTooLarge, server_error

Endpoint = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except APIError as e:
            response = e.response()
        except BodyTooLarge:
            raise  # gateway/body_limit.py answers it
        except ClientDisconnect:
            return  # gone while its body was read: nobody to answer
        except Exception:
            # as the app's handler of last resort does: an OpenAI-shaped 500, and the error raised on to be logged
            await server_error().response()(scope, receive, send)
            raise
        await response(scope, receive, send)
