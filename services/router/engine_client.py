"""EngineClient: the router's HTTP calls to engines, with failures sorted into retryable or not."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.common.openai.errors import OpenAIError
from services.common.openai.sse import SSEEvent, aiter_sse


class EngineUnavailable(Exception):
    """The engine could not serve the request (connection, 5xx, broken stream): try another one."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class KVMoved(EngineUnavailable):
    """A draining decode ended the stream and leased its KV: ``params`` tell the next decode where it is."""

    def __init__(self, url: str, params: dict[str, Any]) -> None:
        super().__init__(url, "draining: its KV waits for the next decode")
        self.params = params


def _rejection(status: int, body: bytes) -> OpenAIError:
    """A 4xx answer as the OpenAIError to hand back to the client unchanged."""
    try:
        info = json.loads(body)["error"]
        return OpenAIError(status, info["message"], info["type"], info.get("param"), info.get("code"))
    except (ValueError, KeyError, TypeError):
        return OpenAIError(status, body.decode(errors="replace")[:500] or "rejected", "invalid_request_error")


def _check(url: str, status: int, body: bytes) -> None:
    if status >= 500 or status in (408, 429):
        raise EngineUnavailable(url, f"HTTP {status}: {body[:200].decode(errors='replace')}")
    if status >= 400:
        raise _rejection(status, body)


def _is_server_error(event: SSEEvent) -> bool:
    try:
        data = event.json()
    except ValueError:
        return False
    return (
        isinstance(data, dict)
        and isinstance(data.get("error"), dict)
        and data["error"].get("type") == "server_error"
    )


@dataclass
class EngineStream:
    """An open SSE stream whose first event has arrived; iterate ``events()`` for all of them."""

    url: str
    first: SSEEvent
    rest: AsyncIterator[SSEEvent]
    response: httpx.Response
    on_close: list[Callable[[int], None]] = field(default_factory=list)  # called once with ``seen``
    seen: int = 1  # data events received, [DONE] not counted (about one per generated token)

    async def events(self) -> AsyncGenerator[SSEEvent, None]:
        """The first event, then the rest; raises EngineUnavailable when the stream breaks."""
        try:
            yield self.first
            async for event in self.rest:
                self.seen += not event.is_done
                yield event
        except httpx.HTTPError as exc:
            raise EngineUnavailable(self.url, f"stream broke: {exc!r}") from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.response.aclose()
        listeners, self.on_close = self.on_close, []
        for listener in listeners:
            listener(self.seen)


class EngineClient:
    """POSTs to ``{url}/v1/completions``; 4xx raise OpenAIError, anything else failing EngineUnavailable."""

    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``headers``: sent on every call (the engines' Authorization, when they require a key)."""
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)

    async def complete(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        path: str = "/v1/completions",
    ) -> dict[str, Any]:
        """A non-streamed answer's JSON body (a completion, or ``path``'s: e.g. /v1/embeddings)."""
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            response = await self._client.post(f"{url}{path}", json=body, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(url, repr(exc)) from exc
        _check(url, response.status_code, response.content)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineUnavailable(url, "answer is not JSON") from exc

    async def stream(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> EngineStream:
        """Open a streamed completion and wait for its first event (the first token, or an error)."""
        request = self._client.build_request("POST", f"{url}/v1/completions", json=body, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(url, repr(exc)) from exc
        try:
            if response.status_code != 200:
                _check(url, response.status_code, await response.aread())
            events = aiter_sse(response.aiter_bytes())
            first = await anext(events, None)
        except httpx.HTTPError as exc:
            await response.aclose()
            raise EngineUnavailable(url, f"stream broke before the first event: {exc!r}") from exc
        except BaseException:
            await response.aclose()
            raise
        if first is None or _is_server_error(first):
            await response.aclose()
            raise EngineUnavailable(
                url, "stream ended before the first token" if first is None else first.data
            )
        return EngineStream(url, first, events, response)

    async def get(self, url: str, timeout_s: float = 2.0) -> httpx.Response:
        return await self._client.get(url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()
