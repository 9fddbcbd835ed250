"""RequestIdMiddleware: echo (or mint) ``X-Request-Id``; answer 401 on ``/v1`` routes without the API key."""

from __future__ import annotations

import secrets
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.errors import unauthorized

_MAX_ID_LEN = 128


def authorized(headers: Headers, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class RequestIdMiddleware:
    """Pure ASGI, so streamed responses and client disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")[:_MAX_ID_LEN] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        if self.api_key and scope["path"].startswith("/v1") and not authorized(headers, self.api_key):
            error = unauthorized()
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)
