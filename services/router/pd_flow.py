"""PDFlow: pick -> (prefill, max_tokens=1, do_remote_decode) -> decode with the returned params.

One request's path through the pool, top to bottom:

1. the scheduler picks a decode endpoint, and a prefill endpoint when the uncached part of the prompt
   is at least ``--pd-threshold`` tokens (P/D pools only);
2. prefill computes the prompt and answers ``kv_transfer_params`` naming its blocks; if it fails for
   any reason the request is served decode-only (decode recomputes the prompt) and the fallback is
   counted; without prefill, when another engine holds a long prefix the picked one lacks, that engine
   leases it (``services/router/p2p``) and the picked one READs it;
3. decode gets the original request plus those params; a failure before its first token (connection
   refused, 5xx, a stream that ends or errors before any token) is retried once on another endpoint;
4. the caller streams decode's answer back; after the first token a failure is migrated to another
   engine (services/router/migration), or ends the stream with a clean error event.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from services.common.kv.kv_transfer import KVTransferParams
from services.common.openai.errors import OpenAIError
from services.common.openai.protocol_structured import CONSTRAINT_FIELDS
from services.router.circuit_breaker import CircuitBreaker
from services.router.engine_client import EngineClient, EngineStream, EngineUnavailable
from services.router.metrics import RouterMetrics
from services.router.p2p.prefix_pull import PrefixPull
from services.router.prompt import PreparedRequest
from services.router.scheduling import Endpoint, RequestContext, RouteDecision, Scheduler

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first try and one retry elsewhere
# Prefill computes the prompt and discards its one token: decode samples (and constrains) every output
# token, so output-shaping fields never reach prefill (no grammar compiled there for nothing).
_PREFILL_DROPPED = (
    "stream_options",
    "logprobs",
    "echo",
    "min_tokens",
    "n",
    *CONSTRAINT_FIELDS,
    "structured_outputs_after",
)


# Called at every pick of the scheduler with the request's id and the attempt (0 first, 1 the retry).
RouteListener = Callable[[RouteDecision, PreparedRequest, RequestContext, str, int], None]


def no_endpoint(reason: str) -> OpenAIError:
    """503 when no engine can take the request."""
    return OpenAIError(
        503, f"No engine could serve this request: {reason}", "server_error", None, "service_unavailable"
    )


@dataclass
class Dispatched:
    """Decode's answer: a JSON body, or an open stream whose first event arrived."""

    decision: RouteDecision
    overhead_s: float
    body: dict[str, Any] | None = None
    stream: EngineStream | None = None

    def headers(self) -> dict[str, str]:
        """Where the request went and what routing cost (for clients, tests and the benchmark)."""
        out = {
            "X-Kvferry-Endpoint": self.decision.decode.url,
            "X-Kvferry-Route-Ms": f"{self.overhead_s * 1000:.3f}",
        }
        if self.decision.prefill is not None:
            out["X-Kvferry-Prefill"] = self.decision.prefill.url
        return out


class PDFlow:
    """Routes one PreparedRequest through prefill (when worth it) and decode, with one retry."""

    def __init__(
        self,
        scheduler: Scheduler,
        endpoints: Callable[[], Sequence[Endpoint]],
        client: EngineClient,
        metrics: RouterMetrics,
        prefill_timeout_s: float = 60.0,
        on_route: RouteListener | None = None,
    ) -> None:
        self.on_route = on_route  # e.g. tell the shared index where this prefix went (other replicas follow)
        self.scheduler = scheduler
        self.endpoints = endpoints
        self.client = client
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self.max_attempts = MAX_ATTEMPTS
        self.retry_jitter_s = 0.0  # a retry first waits up to this long times its number
        self.breaker: CircuitBreaker | None = None  # engines failing in a row are left out for a while
        self.p2p: PrefixPull | None = None  # the picked engine READs a long prefix another engine holds

    async def run(
        self, req: PreparedRequest, ctx: RequestContext, request_id: str, exclude: Sequence[str] = ()
    ) -> Dispatched:
        """Pick (never a decode in ``exclude``), prefill, decode; raises OpenAIError (4xx from an engine, or
        503 when none could serve)."""
        tried: list[str] = list(exclude)
        failure: EngineUnavailable | None = None
        overhead = 0.0
        for attempt in range(self.max_attempts):
            if attempt and self.retry_jitter_s:
                await asyncio.sleep(random.uniform(0, self.retry_jitter_s * attempt))
            decision = self.scheduler.schedule(self.endpoints(), ctx, exclude=self._excluded(tried))
            if decision is None:
                break
            if attempt == 0:
                overhead = self.record(decision, req, ctx)
            else:
                self.metrics.retries.inc()
                log.warning("request %s: retrying on %s after %s", request_id, decision.decode.url, failure)
            if self.on_route is not None:
                self.on_route(decision, req, ctx, request_id, attempt)
            headers = {"X-Request-Id": f"{request_id}-{attempt}" if attempt else request_id}
            moved = (req.engine_body.get("kv_transfer_params") or {}).get("do_remote_prefill", False)
            params = await self._prefill(decision, req, headers) if decision.prefill and not moved else None
            if params is None and not moved:
                params = await self._pull(decision, req, ctx)
            url = decision.decode.url
            if self.breaker is not None:
                self.breaker.picked(url)
            try:
                dispatched = await self._decode(decision, req, params, headers, overhead)
            except EngineUnavailable as exc:
                failure = exc
                tried.append(url)
                if self.breaker is not None:
                    self.breaker.failed(url)
                continue
            if self.breaker is not None:
                self.breaker.succeeded(url)
            return dispatched
        if failure is None:
            self.metrics.requests.labels(decision="no_endpoint").inc()
            raise no_endpoint("no healthy engine")
        raise no_endpoint(f"the engines failed ({failure.reason})")

    def _excluded(self, tried: list[str]) -> list[str]:
        """Engines tried already, and those whose circuit is open (unless that is every one left)."""
        if self.breaker is None:
            return tried
        left = [e.url for e in self.endpoints() if e.healthy and e.url not in tried]
        return tried + sorted(self.breaker.blocked(left))

    def record(self, decision: RouteDecision, req: PreparedRequest, ctx: RequestContext) -> float:
        """Count one routing decision (the router's own and the EPP's); the overhead so far, in seconds."""
        m = self.metrics
        m.requests.labels(decision=decision.mode).inc()
        if ctx.block_size:
            m.prompt_blocks.inc(ctx.prompt_blocks)
            m.prefix_hit_blocks.inc(decision.cached_tokens // ctx.block_size)
        overhead = time.perf_counter() - req.arrival
        m.overhead.observe(overhead)
        return overhead

    async def _prefill(
        self, decision: RouteDecision, req: PreparedRequest, headers: dict[str, str]
    ) -> dict[str, Any] | None:
        """Prefill's ``kv_transfer_params``; ``None`` (decode-only, counted) when anything goes wrong."""
        assert decision.prefill is not None
        body = {k: v for k, v in req.engine_body.items() if k not in _PREFILL_DROPPED}
        body.update(
            prompt=req.prompts[0], max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}
        )
        url = decision.prefill.url
        try:
            answer = await self.client.complete(url, body, headers, timeout_s=self.prefill_timeout_s)
            params = KVTransferParams.model_validate(answer.get("kv_transfer_params") or {})
            if not params.do_remote_prefill:
                raise ValueError("the answer carries no do_remote_prefill kv_transfer_params")
        except (EngineUnavailable, OpenAIError, ValidationError, ValueError) as exc:
            self.metrics.fallbacks.labels(kind="prefill").inc()
            log.warning("prefill on %s failed (%s); serving decode-only", url, exc)
            return None
        return answer["kv_transfer_params"]

    async def _pull(
        self, decision: RouteDecision, req: PreparedRequest, ctx: RequestContext
    ) -> dict[str, Any] | None:
        """A peer's lease of the prompt's cached prefix for the picked engine (None: it computes the prompt)."""
        if self.p2p is None or (holder := self.p2p.holder(decision, ctx, self.endpoints())) is None:
            return None
        return await self.p2p.lease(holder, req.block_hashes, ctx.lora_name)

    async def _decode(
        self,
        decision: RouteDecision,
        req: PreparedRequest,
        params: dict[str, Any] | None,
        headers: dict[str, str],
        overhead: float,
    ) -> Dispatched:
        body = dict(req.engine_body)
        if (
            params is not None
        ):  # prefill's (or a peer's) answer, with what the router asked (migrate_on_drain)
            body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        url = decision.decode.url
        if req.stream:
            return Dispatched(decision, overhead, stream=await self.client.stream(url, body, headers))
        return Dispatched(decision, overhead, body=await self.client.complete(url, body, headers))
