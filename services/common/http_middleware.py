"""HTTP plumbing shared by the engine server and the router: request ids, API key, OpenAI error bodies."""

from __future__ import annotations

import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.errors import OpenAIError, server_error, unauthorized, validation_error_response

_MAX_ID_LEN = 128


def _authorized(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class RequestContextMiddleware:
    """Sets ``request.state.request_id`` (and the response header) and ``request.state.arrival`` (perf_counter
    when the request's headers arrived); answers 401 for a bad API key.

    Pure ASGI (not ``BaseHTTPMiddleware``), so streamed responses and disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")[:_MAX_ID_LEN] or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival"] = request_id, time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        if self.api_key and scope["path"].startswith("/v1") and not _authorized(headers, self.api_key):
            error = unauthorized()
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Every error leaves as OpenAI error JSON: ours, FastAPI's validation (400), HTTP errors, and the rest (500)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = validation_error_response(exc.errors())
        return JSONResponse(body, status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = OpenAIError(exc.status_code, str(exc.detail), kind).body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error: %r", exc, exc_info=exc)
        error = server_error()
        return JSONResponse(error.body(), status_code=error.status)
