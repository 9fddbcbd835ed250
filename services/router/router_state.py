"""RouterState: the parts of one router replica (poller, index, scheduler, flow, self-check) and their life."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.kv.hashing import HASH_VERSION, BlockHasher
from services.common.kv.prefix_index import AsyncPrefixIndex, PrefixMatch
from services.common.media.mm_placeholders import media_placeholders
from services.common.openai.chat_tools import ToolSettings, check_tool_settings
from services.common.openai.tokenizer import Tokenizer
from services.router.accuracy.prediction_accuracy import PredictionAccuracy
from services.router.admission.admission import Admission
from services.router.circuit_breaker import CircuitBreaker
from services.router.context_limit import pool_max_model_len
from services.router.decision_log import DecisionLog
from services.router.discovery import KubernetesDiscovery
from services.router.endpoints import EndpointPoller
from services.router.engine_client import EngineClient
from services.router.engine_history import EngineHistory
from services.router.metrics import RouterMetrics
from services.router.migration.migrator import Migrator
from services.router.p2p.prefix_pull import PrefixPull
from services.router.pd_flow import PDFlow
from services.router.prompt import PreparedRequest, PromptPreparer
from services.router.scheduling import RequestContext, RouteDecision, Scheduler
from services.router.self_check import PROBE_TEXT, SelfCheck, probe_ids
from services.router.sessions.session_affinity import SessionAffinity
from services.router.settings import RouterSettings


@dataclass
class RouterState:
    """Built once per app; ``start``/``stop`` run in the app's lifespan."""

    settings: RouterSettings
    tokenizer: Tokenizer
    metrics: RouterMetrics
    preparer: PromptPreparer
    poller: EndpointPoller
    client: EngineClient
    index: AsyncPrefixIndex | None
    flow: PDFlow
    self_check: SelfCheck
    decisions: DecisionLog  # the last routing decisions (the pool page)
    history: EngineHistory  # per-engine latency series, fed by every poll (the pool page)
    tasks: list[asyncio.Task] = field(default_factory=list)
    background: set[asyncio.Task] = field(default_factory=set)
    discovery: KubernetesDiscovery | None = None
    sessions: SessionAffinity | None = None  # --session-affinity
    migrator: Migrator = field(init=False)  # streams resumed on another engine when theirs fails
    accuracy: PredictionAccuracy = field(init=False)  # predicted vs reported cached tokens, per engine
    admission: Admission | None = None  # tenants, quotas, flow control

    @classmethod
    def build(cls, settings: RouterSettings, rng: random.Random | None = None) -> RouterState:
        tokenizer = Tokenizer(settings.tokenizer)
        if settings.chat_template:
            tokenizer.set_chat_template(settings.chat_template)
        tools = ToolSettings(
            settings.enable_auto_tool_choice,
            settings.tool_call_parser,
            settings.reasoning_parser,
            tokenizer.chat_template is not None and tokenizer.renders_tools(),
        )
        check_tool_settings(tools)
        hasher = BlockHasher(settings.model_name, settings.block_size, HASH_VERSION)
        metrics = RouterMetrics(with_index=bool(settings.redis_url))
        auth = {"Authorization": f"Bearer {settings.engine_api_key}"} if settings.engine_api_key else {}
        poller = EndpointPoller(settings.endpoints, settings.poller, headers=auth)
        client = EngineClient(settings.connect_timeout_s, settings.request_timeout_s, headers=auth)
        index = (
            AsyncPrefixIndex.from_url(settings.redis_url, budget_s=settings.index_budget_s)
            if settings.redis_url
            else None
        )
        flow = PDFlow(
            Scheduler(settings.scheduling, rng), poller.endpoints, client, metrics, settings.prefill_timeout_s
        )
        probe = probe_ids(tokenizer.encode(PROBE_TEXT * 4, add_special_tokens=False), settings.block_size)
        check = SelfCheck(
            poller,
            client,
            index,
            hasher,
            probe,
            metrics,
            settings.self_check_interval_s,
            settings.probe_timeout_s,
        )
        state = cls(
            settings,
            tokenizer,
            metrics,
            PromptPreparer(
                tokenizer,
                hasher,
                tools,
                media_placeholders(settings.tokenizer),
                settings.remote_media,
                settings.limit_mm_per_prompt,
            ),
            poller,
            client,
            index,
            flow,
            check,
            DecisionLog(settings.scheduling.pd_threshold, index is not None),
            EngineHistory(),
        )
        poller.listeners.append(state.history.observe)
        state.admission = Admission.build(
            settings.admission, poller.endpoints, metrics.registry, settings.redis_url
        )
        poller.listeners.append(state.admission.kick)
        state.sessions = SessionAffinity.build(settings.sessions, settings.redis_url)
        flow.on_route = state.note_route
        flow.p2p = PrefixPull(settings.p2p, client, metrics.registry)
        state.migrator = Migrator(state, settings.migration)
        state.accuracy = PredictionAccuracy(settings.accuracy, settings.block_size, metrics.registry)
        flow.max_attempts = settings.breaker.retries + 1
        flow.retry_jitter_s = settings.breaker.retry_jitter_s
        flow.breaker = CircuitBreaker(settings.breaker, metrics.registry)
        return state

    def note_route(
        self,
        decision: RouteDecision,
        req: PreparedRequest,
        ctx: RequestContext,
        request_id: str,
        attempt: int,
    ) -> None:
        """Log the decision; write the routed hint for the chosen engines in the background (off the
        request's path)."""
        self.decisions.add(decision, req, ctx, request_id, attempt)
        if self.sessions is not None and ctx.session is not None:  # the session follows its engine
            self._background(self.sessions.remember(ctx.session, decision.decode.url))
        if self.index is None or not req.block_hashes:
            return
        for endpoint in (decision.decode, decision.prefill):
            match = ctx.match(endpoint) if endpoint is not None else None
            if match is not None:
                task = asyncio.create_task(self.index.note_routed(match.engine_id, req.block_hashes))
                self.background.add(task)
                task.add_done_callback(self.background.discard)

    async def start(self) -> None:
        """Discovery (if any) and a first poll, index script loaded, then the background loops as tasks."""
        if self.settings.discovery is not None:
            self.discovery = KubernetesDiscovery(self.settings.discovery, self.poller.set_specs)
            await self.discovery.refresh()
            self.tasks.append(asyncio.create_task(self.discovery.run(), name="router-discovery"))
        await self.poller.poll_once()
        if self.index is not None:
            await self.index.prepare()
        self.poller.start()
        self.tasks.append(asyncio.create_task(self.self_check.run_forever(), name="router-self-check"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.poller.stop()
        if self.discovery is not None:
            await self.discovery.aclose()
        await self.client.aclose()
        if self.index is not None:
            await self.index.aclose()
        if self.sessions is not None:
            await self.sessions.kv.aclose()
        if self.admission is not None:
            await self.admission.aclose()

    def max_model_len(self) -> int | None:
        """The pool's context length: the smallest the engines report (None before any answered)."""
        return pool_max_model_len(self.poller.endpoints())

    def lora_adapters(self) -> set[str]:
        """The LoRA adapters some healthy engine serves (requests may name them as their model)."""
        return {a for e in self.poller.endpoints() if e.healthy for a in e.lora_adapters}

    async def context(self, req: PreparedRequest) -> RequestContext:
        """The index's view of the prompt (``None`` matches: Redis down or slow, route by load, counted)."""
        bs, lora = self.settings.block_size, req.lora_name
        if self.index is None or not req.block_hashes:
            none_found: dict[str, PrefixMatch] | None = (
                {} if self.index is not None else None
            )  # no blocks to look up / no index
            ctx = RequestContext(req.prompt_tokens, bs, none_found, splittable=req.splittable, lora_name=lora)
            return self.accuracy.trusting(await self._steer(req, ctx))
        t0 = time.perf_counter()
        matches = await self.index.lookup(req.block_hashes)
        self.metrics.lookup_latency.observe(time.perf_counter() - t0)
        if matches is None:
            self.metrics.fallbacks.labels(kind="index").inc()
        context = RequestContext.from_lookup(req.prompt_tokens, bs, matches)
        steered = await self._steer(req, replace(context, splittable=req.splittable, lora_name=lora))
        return self.accuracy.trusting(steered)  # an engine whose predictions go wrong: load only

    async def _steer(self, req: PreparedRequest, ctx: RequestContext) -> RequestContext:
        """Session affinity: the session's warm engine while it is not saturated."""
        if self.sessions is None or req.session is None:
            return ctx
        sticky, why = await self.sessions.steer(req.session, self.poller.endpoints())
        return replace(ctx, session=req.session, sticky_url=sticky, affinity=why)

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
