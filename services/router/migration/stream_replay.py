"""StreamReplay: relays a stream and, when its engine fails mid-way, resumes it on another engine.

A failure is a broken connection, a 5xx or server-error event, a stream that ends unfinished, or silence
past ``stall_timeout_s``. The request goes again through the flow (prefix-scored, P/D when it pays) with
prompt + the tokens so far as its prompt, the remaining ``max_tokens`` and ``min_tokens``, the same seed
(its draws are keyed by absolute position) and ``resumed_output_tokens`` (penalties count those tokens as
output); the Splice makes the engines' events one stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.common.kv.hashing import BlockHashExtras
from services.common.openai.sse import SSEEvent
from services.router.engine_client import EngineStream, EngineUnavailable, KVMoved
from services.router.migration.splice import Splice
from services.router.prompt import PreparedRequest

if TYPE_CHECKING:
    from services.router.migration.migrator import Migrator

log = logging.getLogger(__name__)


def _server_error(data: object) -> str | None:
    """The message of an engine's in-stream server error event (None for anything else)."""
    if (
        isinstance(data, dict)
        and isinstance(err := data.get("error"), dict)
        and err.get("type") == "server_error"
    ):
        return str(err.get("message"))
    return None


class StreamReplay:
    """One streaming request's events, across as many engines as its migrations needed."""

    def __init__(
        self,
        migrator: Migrator,
        req: PreparedRequest,
        request_id: str,
        stream: EngineStream,
        splice: Splice,
        on_usage: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``on_usage``: called with the first engine's usage chunk (not a continuation's)."""
        self.on_usage = on_usage
        self.m = migrator
        self.req = req
        self.request_id = request_id
        self.stream = stream
        self.splice = splice
        self.failed: list[str] = []
        self.migrations = 0

    def trailer(self) -> bytes:
        """An SSE comment after [DONE] saying how many migrations the stream took (clients ignore comments)."""
        return f": kvferry-migrations {self.migrations}\n\n".encode()

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def events(self) -> AsyncGenerator[SSEEvent, None]:
        """The spliced events; raises EngineUnavailable when a failure cannot be migrated."""
        try:
            while True:
                try:
                    async for event in self._relay(self.stream):
                        yield event
                    return
                except EngineUnavailable as exc:
                    await self.stream.aclose()
                    self.failed.append(self.stream.url)
                    if self._out_of_tokens():  # it failed after its last token, before saying so
                        yield self.splice.finish_event("length")
                        yield SSEEvent("[DONE]")
                        return
                    self.stream = await self._resume(exc)
        finally:
            await self.stream.aclose()

    async def _relay(self, stream: EngineStream) -> AsyncGenerator[SSEEvent, None]:
        events = stream.events()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.m.settings.stall_timeout_s):
                        event = await anext(events, None)
                except TimeoutError:
                    raise EngineUnavailable(
                        stream.url, "stalled: no event within the stall timeout"
                    ) from None
                if event is None or event.is_done:
                    if not self.splice.finished:
                        raise EngineUnavailable(stream.url, "the stream ended before its last token")
                    yield SSEEvent("[DONE]")
                    return
                data = event.json()
                if (message := _server_error(data)) is not None:
                    raise EngineUnavailable(stream.url, message)
                if isinstance(moved := data.get("kv_transfer_params"), dict) and moved.get(
                    "do_remote_prefill"
                ):
                    raise KVMoved(stream.url, moved)
                if data.get("usage") and not self.splice.migrated and self.on_usage is not None:
                    self.on_usage(data)
                out, stop = self.splice.rewrite(event)
                for item in out:
                    yield item
                if stop is not None:  # a stop string spanning the splice ended it; the engine stops with us
                    log.info(
                        "request %s: stop string %r spans the splice; stream ended", self.request_id, stop
                    )
                    if self.req.include_usage:
                        yield self.splice.usage_event(self.req.prompt_tokens)
                    yield SSEEvent("[DONE]")
                    return
        finally:
            await events.aclose()

    def _out_of_tokens(self) -> bool:
        limit = self.req.engine_body.get("max_tokens")
        return limit is not None and len(self.splice.ids) >= limit

    async def _resume(self, failure: EngineUnavailable) -> EngineStream:
        """Open the stream's continuation on another engine; EngineUnavailable when it cannot be."""
        if self.migrations >= self.m.settings.attempts:
            self.m.count("exhausted")
            raise failure
        self.migrations += 1
        tokens = len(self.splice.ids)
        self.splice.resume(self.m.state.tokenizer)  # the tokens the continuation starts from
        moved = failure.params if isinstance(failure, KVMoved) else None
        req = self._continuation(self.splice.ids, moved)
        log.warning(
            "request %s: %s failed after %d tokens (%s); migrating (%d of at most %d)",
            self.request_id,
            failure.url,
            tokens,
            failure.reason,
            self.migrations,
            self.m.settings.attempts,
        )
        try:
            async with asyncio.timeout(self.m.settings.stall_timeout_s):  # its first token, too
                ctx = await self.m.state.context(req)
                rid = f"{self.request_id}-m{self.migrations}"
                d = await self.m.state.flow.run(req, ctx, rid, self.failed)
        except Exception as exc:  # no engine left, it refused, or it stalled: the client gets the error event
            self.m.count("refused")
            raise EngineUnavailable(failure.url, f"{failure.reason}; migration failed: {exc}") from exc
        assert d.stream is not None
        self.m.count("moved" if moved else "resumed")
        return d.stream

    def _continuation(self, ids: list[int], moved: dict[str, Any] | None = None) -> PreparedRequest:
        """The request as another engine continues it: prompt + the tokens so far (their KV where ``moved``
        says, when a draining decode leased it)."""
        body = dict(self.req.engine_body)
        if moved is not None:
            body["kv_transfer_params"] = {**moved, "migrate_on_drain": True}
        prompt = self.req.prompts[0] + ids
        body["prompt"] = prompt
        if body.get("max_tokens") is not None:
            body["max_tokens"] = body["max_tokens"] - len(ids)  # >= 1: see _out_of_tokens
        if body.get("min_tokens"):
            body["min_tokens"] = max(body["min_tokens"] - len(ids), 0)
        body["resumed_output_tokens"] = len(ids)
        extras = BlockHashExtras(cache_salt=body.get("cache_salt"), lora_name=self.req.lora_name)
        hashes = self.m.state.preparer.hasher.hash_tokens(prompt, extras)
        return replace(
            self.req, prompts=[prompt], block_hashes=hashes, engine_body=body, arrival=time.perf_counter()
        )
