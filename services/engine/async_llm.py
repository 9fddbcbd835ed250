"""AsyncLLM: one background engine thread; ``generate()`` streams outputs per request to asyncio callers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.config import EngineConfig
from services.engine.core.engine_request import EngineRequest
from services.engine.core.latency_histogram import LatencyHistogram
from services.engine.core.mm_input import MMInput
from services.engine.core.pooling_params import PoolingParams
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.spec_stats import SpecDecodingStats
from services.engine.engine_core import EngineCore
from services.engine.executor.worker_messages import WorkerDiedError
from services.engine.kv_transfer.context import ConnectorFactory, aggregated_connectors
from services.engine.llm_engine import LLMEngine, RequestOutput

if TYPE_CHECKING:
    from services.common.kv.kv_event_publisher import KVEventPublisher

log = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_S = 0.25  # nothing to do: wake this often (lease expiry, notifications)
_POLL_S = 0.001  # requests wait on remote KV: poll transfers this often


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class _Add:
    request: EngineRequest
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _LoRAUpdate:
    """Load (path set) or unload (path None) an adapter on the engine thread."""

    name: str
    path: str | None
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn`` on the engine thread, between steps (``AsyncLLM.call``)."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _MigrateOut:
    """Drain: end the streams that opted in with their KV leased (``LLMEngine.migrate_out``)."""


@dataclass(frozen=True)
class LoRAStats:
    """Adapters in use (distinct, sorted) and slot churn, for /metrics."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    loads: int
    evictions: int
    slots_used: int
    requests: tuple[tuple[str, int], ...] = ()  # (adapter, requests since start)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, read by /metrics and the router."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_blocks: int
    block_size: int
    model: str = ""
    kv_transfer_blocks: dict[tuple[str, str], int] = field(
        default_factory=dict
    )  # (direction, path) -> blocks
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    structured_requests: int = 0  # requests with an output constraint, since start
    quantization: str = "none"  # how the weights are held (QuantConfig.describe())
    lora: LoRAStats | None = None  # engines with --enable-lora
    spec: SpecDecodingStats | None = None  # engines with --speculative-config (a copy)
    moe_expert_tokens: list[tuple[int, list[int]]] = field(default_factory=list)  # (layer, per expert)
    mm_cache: tuple[int, int] | None = None  # vision models: encoder-cache (queries, hits) since start
    block_bytes: int = 0  # one KV block of this rank's cache (blocks moved x this = bytes moved)
    kv_tier_blocks: dict[str, int] = field(default_factory=dict)  # tier -> blocks it holds now
    kv_tier_loads: dict[str, LatencyHistogram] = field(default_factory=dict)  # tier -> load latency


class AsyncLLM:
    """Thread-confined LLMEngine driven by a command queue; safe to call from any asyncio loop."""

    def __init__(
        self,
        config: EngineConfig,
        publisher: KVEventPublisher | None = None,
        connectors: ConnectorFactory = aggregated_connectors,
    ) -> None:
        self.engine = LLMEngine(config, connectors)
        self.publisher = publisher
        self.engine.core.kv_manager.pool.record_events = publisher is not None
        self.tokenizer = self.engine.tokenizer
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()  # engine-owned request ids: a client's id is only a label
        self._stop = threading.Event()
        self.fatal: BaseException | None = None  # what stopped the engine loop for good (a dead TP rank)
        self.on_fatal: list[Callable[[], None]] = []  # called (engine thread) when that happens
        self._thread = threading.Thread(target=self._run, name="kvferry-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stats(self) -> EngineStats:
        core = self.engine.core
        kv = core.kv_manager
        transfers = core.kv_transfer_stats()
        blocks, failures = dict(transfers.blocks), dict(transfers.failures)
        return EngineStats(
            core.scheduler.num_running,
            core.scheduler.num_waiting,
            kv.usage,
            kv.prefix_queries,
            kv.prefix_hits,
            core.scheduler.num_preemptions,
            core.num_blocks,
            core.block_size,
            self.config.model_name,
            blocks,
            failures,
            self.engine.structured.num_constrained,
            core.quant.describe(),
            _lora_stats(core),
            _spec_stats(core),
            core.moe_expert_tokens(),
            _mm_cache(core),
            core.kv_block_bytes,
            dict(transfers.held),
            dict(transfers.loads),
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        pooling: PoolingParams | None = None,
        lora_name: str | None = None,
        mm_inputs: tuple[MMInput, ...] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``submit`` of a request built here (``engine.make_request``: ValueError naming the field).

        ``pooling``: an embedding request (one output, with ``embedding``), for engines with task 'embed'.
        ``mm_inputs``: the prompt's images and videos, from ``engine.expand_media`` (vision-language models;
        ``prompt_token_ids`` are the expanded ids).
        """
        request = self.engine.make_request(
            prompt_token_ids, params, request_id, cache_salt=cache_salt, lora_name=lora_name,
            priority=priority, kv_transfer_params=kv_transfer_params, pooling=pooling,
            mm_inputs=mm_inputs or (),
        )  # fmt: skip
        async with aclosing(self.submit(request)) as outputs:
            async for out in outputs:
                yield out

    async def submit(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput per engine step for this request (validated where it was built: by
        ``engine.make_request``); cancelling the iteration aborts it.

        ``request.request_id`` is a label (logs, the client's echo): the engine keys the request by an id of
        its own (``label#n``, unique per engine), so two requests with the same label never touch each other.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        request_id = f"{request.request_id}#{next(self._ids)}"
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request.with_id(request_id), sink, asyncio.get_running_loop()))
        if self._stop.is_set():  # the loop stopped meanwhile: its last drain may have run before this put
            raise EngineDeadError("the engine loop is not running")
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def migrate_out(self) -> None:
        """Hand every request that opted in to another decode (safe from a signal handler: one queue put)."""
        self._commands.put(_MigrateOut())

    @property
    def num_held_finished(self) -> int:
        """Finished requests whose blocks are still held for a peer (a drain waits for them)."""
        return self.engine.core.num_held_finished

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            # Idle: wait for work. Only waiting on remote KV (or leases): poll the transfers every ms.
            busy = engine.core.last_step_tokens > 0
            self._drain(timeout=None if busy else (_POLL_S if engine.has_unfinished() else _IDLE_S))
            if self._stop.is_set():
                break
            try:
                outputs = engine.step()
            except WorkerDiedError as exc:  # the engine cannot step again: fail everything, stop, say so
                log.critical("engine stopped: %s", exc)
                self.fatal = exc
                self._stop.set()
                self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))
                for hook in self.on_fatal:
                    hook()
                break
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep the loop
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, out.finished)
            if self.publisher is not None:
                self.publisher.publish(engine.core.kv_manager.pool.take_events())
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self._fail_queued(EngineDeadError("the engine stopped before this request ran"))
        if self.publisher is not None:
            self.publisher.close()
        engine.core.shutdown()

    def _drain(self, timeout: float | None) -> None:
        try:
            cmd = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Add | _Abort | _LoRAUpdate | _MigrateOut | _Call) -> None:
        if isinstance(cmd, _Call):
            self._call(cmd)
            return
        if isinstance(cmd, _LoRAUpdate):
            self._update_lora(cmd)
            return
        if isinstance(cmd, _MigrateOut):
            for out in self.engine.migrate_out():
                self._deliver(out.request_id, out, True)
            return
        if isinstance(cmd, _Abort):
            if self._sinks.pop(cmd.request_id, None) is not None:
                self.engine.abort([cmd.request_id])
            return
        rid = cmd.request.request_id
        if rid in self._sinks:  # engine-owned ids never repeat; were one to, it fails alone
            _put(cmd.sink, cmd.loop, ValueError(f"request_id: {rid!r} is already in use"))
            return
        self._sinks[rid] = (cmd.sink, cmd.loop)
        try:
            self.engine.add(cmd.request)
        except (ValueError, LookupError) as exc:  # LookupError: its LoRA adapter was unloaded meanwhile
            self._deliver(rid, exc, True)

    def _update_lora(self, cmd: _LoRAUpdate) -> None:
        try:
            self.engine.core.update_lora(cmd.name, cmd.path)
            result: BaseException | None = None
        except (ValueError, KeyError, OSError) as exc:
            result = exc
        cmd.loop.call_soon_threadsafe(_settle, cmd.done, result)

    def _call(self, cmd: _Call) -> None:
        try:
            result = cmd.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            cmd.loop.call_soon_threadsafe(_settle, cmd.done, exc)
            return
        cmd.loop.call_soon_threadsafe(_resolve, cmd.done, result)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on the engine thread between steps (what touches the scheduler's state from HTTP)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(_Call(fn, done, loop))
        return await done

    async def update_lora(self, name: str, path: str | None) -> None:
        """Load an adapter (``path``) or unload it (None) between engine steps; raises what the engine raised."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(_LoRAUpdate(name, path, done, loop))
        await done

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        entry = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if entry is None:
            return
        sink, loop = entry
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.engine.abort([request_id])

    def _fail_all(self, exc: BaseException) -> None:
        ids = list(self._sinks)
        self.engine.abort(ids)
        for rid in ids:
            self._deliver(rid, exc, True)

    def _fail_queued(self, exc: BaseException) -> None:
        """Commands still queued when the loop ends (sent while it was stopping) get ``exc``, never silence."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _put(cmd.sink, cmd.loop, exc)
            elif isinstance(cmd, _LoRAUpdate | _Call):
                cmd.loop.call_soon_threadsafe(_settle, cmd.done, exc)


def _put(sink: asyncio.Queue, loop: asyncio.AbstractEventLoop, item: BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
        loop.call_soon_threadsafe(sink.put_nowait, item)


def _settle(done: asyncio.Future, error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _spec_stats(core: EngineCore) -> SpecDecodingStats | None:
    if core.config.speculative_config is None:
        return None
    s = core.scheduler.spec_stats
    return SpecDecodingStats(
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos)
    )


def _lora_stats(core: EngineCore) -> LoRAStats | None:
    lora = core.lora
    if lora is None:
        return None
    sched = core.scheduler
    running = sorted({r.lora_name for r in sched.running if r.lora_name})
    waiting = sorted({r.lora_name for r in sched.waiting if r.lora_name})
    used = sum(1 for n in lora.slots if n)
    requests = tuple(sorted(lora.requests.items()))
    return LoRAStats(
        tuple(running), tuple(waiting), len(lora.slots), lora.loads, lora.evictions, used, requests
    )


def _mm_cache(core: EngineCore) -> tuple[int, int] | None:
    cache = core.scheduler.encoder
    return (cache.queries, cache.hits) if cache is not None else None


def _resolve(done: asyncio.Future, result: object) -> None:
    if not done.done():
        done.set_result(result)
