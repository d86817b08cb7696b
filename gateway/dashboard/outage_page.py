"""Dashboard pages while the database is unreachable: a 503 page (with Retry-After) saying so, instead
of a 500. The session cookie is left as it is, so the admin is still signed in once the database is
back; a form POST fails before it changes anything, since every change is a database write."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi.routing import APIRoute
from sqlalchemy.exc import DBAPIError
from starlette.requests import Request
from starlette.responses import Response

from gateway.dashboard.render import page
from gateway.errors import database_unavailable
from gateway.key_db_outage import is_database_outage
from gateway.outage_log import warn_once

OUTAGE_MESSAGE = "The database is unavailable; this page will work again when it is back."


def outage_page() -> Response:
    response = page("error.html", 503, title="Database unavailable", message=OUTAGE_MESSAGE)
    response.headers.update(database_unavailable().headers)  # the same Retry-After as the admin API's 503
    return response


class OutagePageRoute(APIRoute):
    """A dashboard route whose database-unreachable errors, in its guards (the session's admin-key
    check) or in its handler (the page's data), become the outage page; other errors pass through."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handler_or_outage_page(request: Request) -> Response:
            try:
                return await handler(request)
            except DBAPIError as error:
                if not is_database_outage(error):
                    raise
                warn_once("dashboard database unreachable; its pages answer 503 until it is back")
                return outage_page()

        return handler_or_outage_page
