"""Request and server lifecycle: readiness, warm-up, drain, client-disconnect aborts, SSE clean-up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.common.openai.errors import OpenAIError, not_ready
from services.common.openai.sse import SSE_CONTENT_TYPE
from services.engine.async_llm import AsyncLLM
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class Failable(Protocol):
    """An in-flight request that can be failed from outside (see ``Generation.fail``)."""

    def fail(self, error: OpenAIError) -> None: ...


@dataclass
class ServerState:
    """Readiness (ready after warm-up, not once draining) and the requests in flight.

    ``begin_drain`` is safe to call from a signal handler: after ``drain_timeout`` every request still
    in flight is failed with a 503 (streams end with an error event and ``[DONE]``, not a cut).
    """

    drain_timeout: float = 30.0
    warmed_up: bool = False
    draining: bool = False
    in_flight: set[Failable] = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None
    on_drain: list[Callable[[], None]] = field(
        default_factory=list
    )  # signal-safe hooks (a decode's migrate_out)
    expiry: asyncio.Task | None = field(default=None, init=False, repr=False)

    def is_ready(self, llm: AsyncLLM) -> bool:
        """True when requests may be served."""
        return self.warmed_up and not self.draining and llm.is_alive

    def begin_drain(self) -> None:
        """Stop being ready; fail what is still running after ``drain_timeout`` seconds."""
        if self.draining:
            return
        self.draining = True
        for hook in self.on_drain:
            hook()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_expiry)

    def _start_expiry(self) -> None:
        self.expiry = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        for request in list(self.in_flight):
            request.fail(not_ready("The server shut down before this request finished; it was aborted."))


async def wait_for_held_kv(llm: AsyncLLM, timeout: float) -> None:
    """Before the engine stops: wait (up to ``timeout`` s) until no peer still has to READ blocks held for it."""
    deadline = time.monotonic() + timeout
    while llm.num_held_finished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if llm.num_held_finished:
        log.warning("stopping with %d requests' KV still unread by their next engine", llm.num_held_finished)


async def warm_up(llm: AsyncLLM, state: ServerState) -> None:
    """Generate one token (or embed one input) end to end; the server reports ready only afterwards."""
    ids = llm.tokenizer.encode("warm up") or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    pooling = PoolingParams() if llm.engine.core.task == "embed" else None
    try:
        async for _ in llm.generate(ids, params, "warmup", pooling=pooling):
            pass
    except Exception:  # noqa: BLE001 - stay unready (health 503) and say why
        log.exception("warm-up failed; the server stays unready")
        return
    state.warmed_up = True
    log.info("warm-up done; ready to serve %s", llm.config.model_name)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            log.info("client disconnected; request aborted")
        await asyncio.gather(watcher, task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class SSEResponse(StreamingResponse):
    """An event stream whose body iterator is always closed (client gone, drain timeout, error).

    Closing the iterator closes the generation it reads from, which aborts the engine requests.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type=SSE_CONTENT_TYPE, headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
