"""One `x-request-id` on every response: the client's own when it sent one (as vLLM and most proxies
do), else the completion's id, else a new one. Behind Ray Serve the proxy puts its own on the response;
gateway/serving/ray_backend.py then keeps ours as `x-tollgate-request-id`."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_CLIENT_ID = 200


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k == HEADER), None)
        client_id = given if given is not None and 0 < len(given) <= MAX_CLIENT_ID and given.isascii() else None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                ours = next((v for k, v in message.get("headers", []) if k.lower() == HEADER), None)
                headers.append((HEADER, client_id or ours or f"req_{uuid.uuid4().hex}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
