"""HTTP plumbing shared by the engine server and the router: request ids, API key, OpenAI error bodies."""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import SecretStr
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.openai.errors import OpenAIError, server_error, unauthorized, validation_error_response
from services.common.pool.pool_secret import POOL_SECRET_HEADER, SIDE_CHANNEL_PREFIX, secret_matches

_MAX_ID_LEN = 128


def _bearer_token(headers: Headers) -> bytes | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else None


def _authorized(token: bytes | None, api_keys: Sequence[bytes]) -> bool:
    """Constant time over every key: which key matched, or how far a guess got, does not show in timing."""
    if token is None:
        return False
    matched = False
    for key in api_keys:
        matched |= secrets.compare_digest(token, key)
    return matched


def presented_key(headers: Headers) -> bytes | None:
    """The key a request carries: its Bearer token, or the password of its Basic credentials (what a
    browser sends after its login prompt; the user name is ignored)."""
    token = _bearer_token(headers)
    if token is not None:
        return token
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _, sep, password = decoded.partition(b":")
    return password if sep else None


def key_allowed(token: bytes | None, api_keys: Sequence[bytes]) -> bool:
    """Whether ``token`` is one of ``api_keys`` (constant time over every key)."""
    return _authorized(token, api_keys)


def tenant_of(token: bytes) -> str:
    """A stable, non-reversible id of an API key (for per-tenant cache salts; the key itself is never kept)."""
    return hashlib.sha256(b"kvferry-tenant:" + token).hexdigest()[:32]


class RequestContextMiddleware:
    """Sets ``request.state.request_id`` (and the response header) and ``request.state.arrival`` (perf_counter
    when the request's headers arrived); answers 401 for a bad API key. With several keys (tenants),
    ``request.state.tenant`` is ``tenant_of`` the key the request carried.

    Pure ASGI (not ``BaseHTTPMiddleware``), so streamed responses and disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] = ()) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]

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

        if self.api_keys and scope["path"].startswith("/v1"):
            token = _bearer_token(headers)
            if not _authorized(token, self.api_keys):
                error = unauthorized()
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send_with_id)
                return
            assert token is not None
            state["tenant"] = tenant_of(token)
        await self.app(scope, receive, send_with_id)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Every error leaves as OpenAI error JSON: ours, FastAPI's validation (400), HTTP errors, and the rest (500)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

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


def pool_secret_refused() -> OpenAIError:
    """401 for a side-channel call without the right pool secret."""
    return OpenAIError(
        401,
        f"Missing or wrong pool secret ({POOL_SECRET_HEADER}): side channels serve the pool's own pods only.",
        "invalid_request_error",
        None,
        "invalid_pool_secret",
    )


class SideChannelAuth:
    """ASGI middleware: requests under ``/kv/`` need the pool secret header, else a 401 (OpenAI error JSON).

    Pure ASGI, like ``RequestContextMiddleware``; a None secret passes everything through (as before).
    """

    def __init__(self, app: ASGIApp, secret: SecretStr | None = None) -> None:
        self.app, self.secret = app, secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith(SIDE_CHANNEL_PREFIX)
        if guarded and self.secret is not None:
            presented = Headers(scope=scope).get(POOL_SECRET_HEADER)
            if not secret_matches(presented, self.secret):
                error = pool_secret_refused()
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
