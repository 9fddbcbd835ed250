"""Admission: one request's way in: its tenant and band, its quota (shared by every replica), then the flow
control queue; the Lease it gets is given back when the answer ends (counted tokens refunded or charged)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request
from prometheus_client import CollectorRegistry

from services.common.openai.errors import OpenAIError, bad_request
from services.router.admission.admission_metrics import AdmissionMetrics
from services.router.admission.admission_settings import AdmissionSettings
from services.router.admission.fair_queue import QueueItem
from services.router.admission.flow_controller import ClientGone, FlowController, Gone, Rejected
from services.router.admission.quota_store import (
    MemoryQuotaStore,
    QuotaStore,
    QuotaVerdict,
    RedisQuotaStore,
    ratelimit_headers,
)
from services.router.admission.saturation import SaturationDetector
from services.router.admission.tenants import BAND_NAMES, Band, Quota, Tenant
from services.router.scheduling.endpoint import Endpoint

log = logging.getLogger(__name__)

BAND_HEADER = "x-kvferry-band"
DEFAULT_TENANT = Tenant(name="default", key_id="", band=Band.standard, quota=Quota())


def too_many(
    message: str, code: str, retry_after_s: int, headers: dict[str, str] | None = None
) -> OpenAIError:
    """429 with ``Retry-After`` (and the tenant's ``x-ratelimit-*``); ``code``: rate_limit_exceeded (a quota),
    queue_ttl, queue_full or shed (flow control)."""
    error = OpenAIError(429, message, "rate_limit_exceeded", None, code)
    error.headers = {**(headers or {}), "Retry-After": str(retry_after_s)}
    return error


@dataclass(eq=False)
class Lease:
    """An admitted request: give it back with ``finish`` (idempotent) when its answer ended."""

    admission: Admission
    tenant: Tenant
    band: Band
    charged: int  # prompt + reserved output tokens
    out_reserved: int
    verdict: QuotaVerdict | None
    flow: bool
    headers: dict[str, str] = field(default_factory=dict)
    done: bool = False

    def finish(self, generated: int | None) -> None:
        """Release the flow slot now; settle the quota (tokens not generated refunded) in the background."""
        if self.done:
            return
        self.done = True
        self.admission.settle(self, 0 if generated is None else self.out_reserved - generated)

    def cancel(self) -> None:
        """Not served (refused by flow control, or the client left): the whole charge is refunded."""
        if not self.done:
            self.done = True
            self.admission.settle(self, self.charged)

    def bind(self, body: dict[str, Any] | None, on_close: list[Callable[[int], None]] | None) -> None:
        """Finish on ``body``'s usage, or when the stream whose close-listeners are ``on_close`` ends."""
        if on_close is not None:
            on_close.append(self.finish)
            return
        usage = (body or {}).get("usage") or {}
        self.finish(usage.get("completion_tokens") if isinstance(usage, dict) else None)


class Admission:
    """Tenants by key id, quotas in ``store``, flow control (when on) over ``endpoints``."""

    def __init__(
        self,
        settings: AdmissionSettings,
        endpoints: Callable[[], Sequence[Endpoint]],
        registry: CollectorRegistry,
        store: QuotaStore | None = None,
    ) -> None:
        self.settings = settings
        self.tenants = {t.key_id: t for t in settings.tenants}
        self.store = store or MemoryQuotaStore()
        self.detector = SaturationDetector(settings.limits)
        self.flow = FlowController(self.detector, endpoints, settings.max_queue, time.monotonic)
        self.metrics = AdmissionMetrics(registry)
        names = [t.name for t in settings.tenants] + [DEFAULT_TENANT.name]
        self.metrics.watch(
            names, self.flow.queue.length, lambda: len(self.flow.queue), lambda: self.flow.inflight
        )
        self.background: set[asyncio.Task[None]] = set()

    @classmethod
    def build(
        cls,
        settings: AdmissionSettings,
        endpoints: Callable[[], Sequence[Endpoint]],
        registry: CollectorRegistry,
        redis_url: str | None,
    ) -> Admission:
        """Quotas in the pool's Redis when the router has one (shared by replicas), else in memory."""
        store = RedisQuotaStore.from_url(redis_url) if redis_url and settings.tenants else None
        return cls(settings, endpoints, registry, store)

    def tenant(self, key_id: str | None) -> Tenant:
        return self.tenants.get(key_id or "", DEFAULT_TENANT)

    def band(self, tenant: Tenant, header: str | None) -> Band:
        """The tenant's band, or a lower one the client asked for (never a higher one: 403)."""
        if header is None:
            return tenant.band
        band = Band.parse(header)
        if band is None:
            raise bad_request(
                f"{BAND_HEADER}: must be one of {', '.join(BAND_NAMES)}", BAND_HEADER, "invalid_band"
            )
        if band < tenant.band:
            raise OpenAIError(
                403,
                f"{BAND_HEADER}: tenant {tenant.name} is in band {tenant.band.name} and may only lower it",
                "invalid_request_error",
                BAND_HEADER,
                "band_not_allowed",
            )
        return band

    async def admit(
        self,
        key_id: str | None,
        band_header: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        gone: Gone | None = None,
    ) -> Lease:
        """Quota first (a refused request never queues), then the queue; 429 with Retry-After when refused."""
        tenant = self.tenant(key_id)
        band = self.band(tenant, band_header)
        out = max_tokens if max_tokens is not None else self.settings.out_tokens_estimate
        verdict = await self._charge(tenant, prompt_tokens + out)
        lease = Lease(self, tenant, band, prompt_tokens + out, out, verdict, self.settings.flow_control)
        if verdict is not None:
            lease.headers = ratelimit_headers(tenant.quota, verdict)
        if not self.settings.flow_control:
            self.metrics.decisions.labels(outcome="admitted", reason="immediate").inc()
            return lease
        now = time.monotonic()
        item = QueueItem(band, tenant.name, prompt_tokens + out, now + self.settings.queue_ttl_s[band], now)
        try:
            waited = await self.flow.acquire(item, gone)
        except (Rejected, ClientGone, asyncio.CancelledError) as exc:
            lease.flow = False
            lease.cancel()
            raise self._refused(exc, lease) from None
        self.metrics.decisions.labels(outcome="admitted", reason="queued" if waited else "immediate").inc()
        self.metrics.queue_wait.labels(band=band.name, tenant=tenant.name).observe(waited)
        return lease

    def _refused(self, exc: BaseException, lease: Lease) -> BaseException:
        if isinstance(exc, Rejected):
            outcome = "shed" if exc.reason == "shed" else "rejected"
            self.metrics.decisions.labels(outcome=outcome, reason=exc.reason).inc()
            text = f"Request not admitted ({lease.band.name} band): {exc}. Retry after {exc.retry_after_s}s."
            return too_many(text, exc.reason, exc.retry_after_s, lease.headers)
        self.metrics.decisions.labels(outcome="rejected", reason="client_gone").inc()
        return (
            exc
            if isinstance(exc, asyncio.CancelledError)
            else OpenAIError(499, "client disconnected", "invalid_request_error")
        )

    async def _charge(self, tenant: Tenant, tokens: int) -> QuotaVerdict | None:
        """The tenant's quota check (None: no quota, or the store unreachable: let through, counted)."""
        quota = tenant.quota
        if not (quota.tokens_per_minute or quota.requests_per_minute or quota.max_concurrent):
            return None
        try:
            verdict = await self.store.admit(tenant.name, quota, tokens)
        except (aioredis.RedisError, OSError) as exc:
            self.metrics.quota_errors.inc()
            log.warning("quota store unreachable (%s): tenant %s let through uncounted", exc, tenant.name)
            return None
        if verdict.limit is not None:
            self.metrics.decisions.labels(outcome="rejected", reason=verdict.limit).inc()
            retry = 1 if verdict.limit == "maxConcurrent" else max(1, math.ceil(verdict.reset_s))
            limit = getattr(quota, _FIELDS[verdict.limit])
            raise too_many(
                f"Rate limit reached for tenant {tenant.name}: {verdict.limit} is {limit}. Retry after {retry}s.",
                "rate_limit_exceeded",
                retry,
                ratelimit_headers(quota, verdict),
            )
        self.metrics.quota_requests.labels(tenant=tenant.name).inc()
        self.metrics.quota_tokens.labels(tenant=tenant.name).inc(tokens)
        return verdict

    def settle(self, lease: Lease, adjust: int) -> None:
        """Release the flow slot; give back ``adjust`` tokens (negative: charge more) in the background."""
        if lease.flow:
            self.flow.release()
        if lease.verdict is None:
            return
        if adjust < 0:
            self.metrics.quota_tokens.labels(tenant=lease.tenant.name).inc(-adjust)
        task = asyncio.ensure_future(self._settle(lease, adjust))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _settle(self, lease: Lease, refund: int) -> None:
        assert lease.verdict is not None
        try:
            await self.store.finish(lease.tenant.name, lease.verdict, refund)
        except (aioredis.RedisError, OSError) as exc:
            self.metrics.quota_errors.inc()
            log.warning(
                "quota store unreachable (%s): lease of %s expires on its own", exc, lease.tenant.name
            )

    async def admit_request(self, request: Request, prompt_tokens: int, max_tokens: int | None) -> Lease:
        """``admit`` for an HTTP request: its tenant (the key's id), its band header; it leaves the queue when
        its client disconnects."""
        key_id = getattr(request.state, "tenant", None)
        return await self.admit(
            key_id, request.headers.get(BAND_HEADER), prompt_tokens, max_tokens, lambda: _disconnect(request)
        )

    def kick(self, _reports: object = None) -> None:
        """A poll changed the engines' loads: admit what now fits (a poller listener)."""
        self.flow.polled()

    async def aclose(self) -> None:
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.store.aclose()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


_FIELDS = {
    "tokensPerMinute": "tokens_per_minute",
    "requestsPerMinute": "requests_per_minute",
    "maxConcurrent": "max_concurrent",
}
