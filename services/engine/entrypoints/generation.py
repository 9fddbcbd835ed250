"""Runs the sub-requests of one API request concurrently and yields their outputs as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from services.common.kv.kv_transfer import KVTransferParams
from services.common.openai.errors import OpenAIError, bad_request
from services.common.openai.protocol_common import Usage
from services.engine.async_llm import EngineDeadError
from services.engine.core.engine_request import EngineRequest
from services.engine.core.mm_input import MMInput
from services.engine.entrypoints.serving import ServingContext, SubRequest, engine_error, request_timeout
from services.engine.llm_engine import RequestOutput

_DONE = None  # a sub-request's pump ended
_Item = RequestOutput | Exception | None


@dataclass(frozen=True)
class RequestOptions:
    """Per-API-request engine inputs shared by every sub-request."""

    request_id: str
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: KVTransferParams | None = None
    lora_name: str | None = None  # the LoRA adapter the request's ``model`` names
    # vision models: the prompt's images and videos, preprocessed (its ids are expanded); None: none
    mm_inputs: tuple[MMInput, ...] | None = None


class Generation:
    """The fan-out of one API request; iterate with ``stream()``; ``finals`` holds the last outputs.

    Closing ``stream()`` early (client gone, timeout, error) cancels every sub-request, which aborts it
    in the engine and frees its KV blocks at once.
    """

    def __init__(self, ctx: ServingContext, subs: list[SubRequest], options: RequestOptions) -> None:
        self._ctx, self.subs, self._options = ctx, subs, options
        self.finals: dict[int, RequestOutput] = {}
        self._timers = {s.index: ctx.metrics.timer(len(s.prompt_ids)) for s in subs}
        self._queue: asyncio.Queue[tuple[int, _Item]] = asyncio.Queue()

    async def _pump(self, sub: SubRequest) -> None:
        timer = self._timers[sub.index]
        opts = self._options
        request = EngineRequest(  # the prompt was validated with the API request (serving.subrequests)
            f"{opts.request_id}-{sub.index}",
            tuple(sub.prompt_ids),
            sub.params,
            cache_salt=opts.cache_salt,
            lora_name=opts.lora_name,
            priority=opts.priority,
            kv_transfer_params=opts.kv_transfer_params,
            mm_inputs=opts.mm_inputs or (),
        )
        gen = self._ctx.llm.submit(request)
        try:
            async with aclosing(gen):
                async for out in gen:
                    timer.on_output(len(out.delta_token_ids), out.queue_time_s)
                    if out.finished:
                        timer.finish(out.outputs[0].finish_reason or "stop")
                    self._queue.put_nowait((sub.index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            self._queue.put_nowait((sub.index, exc))
        finally:
            self._queue.put_nowait((sub.index, _DONE))

    async def stream(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Yield ``(choice index, output)`` per engine output until every sub-request finished."""
        timeout = self._ctx.settings.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        tasks = [asyncio.create_task(self._pump(s)) for s in self.subs]
        reason = "abort"
        self._ctx.state.in_flight.add(self)
        try:
            pending = len(tasks)
            while pending:
                index, item = await self._next(deadline)
                if item is _DONE:
                    pending -= 1
                    continue
                if isinstance(item, Exception):
                    reason = "error"
                    raise _as_openai_error(item)
                if item.finished and item.outputs[0].finish_reason == "error":
                    reason = "error"
                    raise engine_error(item.error or "unknown error")
                if item.finished:
                    self.finals[index] = item
                yield index, item
        except TimeoutError:
            reason = "error"
            raise request_timeout(timeout or 0.0) from None
        finally:
            self._ctx.state.in_flight.discard(self)
            await self._cancel(tasks, reason)

    def fail(self, error: OpenAIError) -> None:
        """End this request from outside (drain timeout): ``stream()`` raises ``error`` next."""
        self._queue.put_nowait((-1, error))

    async def _next(self, deadline: float | None) -> tuple[int, _Item]:
        async with asyncio.timeout_at(deadline):
            return await self._queue.get()

    async def _cancel(self, tasks: list[asyncio.Task], reason: str) -> None:
        for task in tasks:
            task.cancel()  # each aborts its engine request, even if this await is cancelled too
        for timer in self._timers.values():
            timer.finish(reason)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> dict[int, RequestOutput]:
        """Run to completion; the final output of every choice, by choice index."""
        async with aclosing(self.stream()) as outputs:
            async for _ in outputs:
                pass
        return self.finals

    def usage(self) -> Usage:
        """Usage over all choices: each prompt counted once, cached tokens from its first sample."""
        prompt = sum(  # as the engine ran it: an image's placeholder counts each of its feature tokens
            len(self.finals[s.index].prompt_token_ids) if s.index in self.finals else len(s.prompt_ids)
            for s in self.subs
            if s.sample == 0
        )
        cached = sum(
            self.finals[s.index].num_cached_tokens
            for s in self.subs
            if s.sample == 0 and s.index in self.finals
        )
        completion = sum(len(out.outputs[0].token_ids) for out in self.finals.values())
        return Usage.of(prompt, completion, cached)


def _as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), "server_error", None, "service_unavailable")
    if isinstance(exc, ValueError):
        param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        return bad_request(str(exc), param if param and param.isidentifier() else None)
    return engine_error(f"{type(exc).__name__}: {exc}")
