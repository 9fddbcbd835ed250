"""SimAdmission: the router's admission (tenants, bands, fair queue, saturation gate, quotas) on the virtual clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, computed_field

from services.common.openai.errors import OpenAIError
from services.router.admission.admission import DEFAULT_TENANT, Admission, Lease
from services.router.admission.admission_settings import DEFAULT_TTL_S, AdmissionSettings
from services.router.admission.quota_store import MemoryQuotaStore
from services.router.admission.tenants import Band, Tenant
from services.router.scheduling import Endpoint
from services.sim.virtual_clock import Timer, VirtualClock

NEVER_S = 1e9  # the real queue's own (wall-clock) time limit: never reached; the virtual one applies
_SETTLE_ROUNDS = 10_000


class BandCounts(BaseModel):
    """One band's requests and what admission did with them (the refused ones a router answers 429)."""

    requests: int = 0
    admitted: int = 0
    queued: int = 0  # admitted after waiting in the queue
    shed: int = 0  # pushed out of a full queue by a more important request
    queue_full: int = 0
    queue_ttl: int = 0  # still queued at the band's time limit
    rate_limited: int = 0  # over the tenant's quota

    @computed_field  # type: ignore[prop-decorator]
    @property
    def refused(self) -> int:
        """What a router answers 429."""
        return self.shed + self.queue_full + self.queue_ttl + self.rate_limited


class SimAdmission:
    """The router's ``Admission`` itself, with its quotas counted on the virtual clock.

    Each request's ``admit`` runs as an asyncio task. Requests wait in the real ``FlowController`` while the
    pool is saturated (``SaturationDetector`` over the polled endpoints); a finished request's lease, or a
    poll, admits the next ones; ``settle`` (the clock's hook after every handler) lets the woken tasks run
    before virtual time moves, so the run stays deterministic. A request still queued at its band's time
    limit (the router's defaults: critical 30 s, standard 15 s, sheddable 5 s) leaves as its client would:
    counted as ``queue_ttl``.
    """

    def __init__(
        self, tenants: Sequence[Tenant], clock: VirtualClock, endpoints: Callable[[], Sequence[Endpoint]]
    ) -> None:
        never = dict.fromkeys(Band, NEVER_S)
        settings = AdmissionSettings(flow_control=True, tenants=tuple(tenants), queue_ttl_s=never)
        store = MemoryQuotaStore(lambda: clock.now)
        self.admission = Admission(settings, endpoints, CollectorRegistry(), store)
        self.clock = clock
        self.by_name = {t.name: t for t in tenants}
        self.counts = {band.name: BandCounts() for band in Band}
        self._tasks: set[asyncio.Task[None]] = set()
        clock.settle = self.settle

    def tenant(self, name: str | None) -> Tenant:
        """The pool's tenant of that name (None: the router's default tenant, band standard)."""
        if name is None:
            return DEFAULT_TENANT
        if name not in self.by_name:
            raise ValueError(f"tenant {name!r} is not one of the pool's ({', '.join(self.by_name)})")
        return self.by_name[name]

    async def request(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int,
        admitted: Callable[[Lease], Awaitable[None]],
    ) -> None:
        """Start one request's admission now; ``admitted(lease)`` runs as a clock handler when it is admitted."""
        counts = self.counts[tenant.band.name]
        counts.requests += 1
        arrived, left = self.clock.now, asyncio.Event()

        async def gone() -> None:
            await left.wait()

        limit: list[Timer] = []  # the time-limit timer, once the request is queued

        async def admit() -> None:
            try:
                lease = await self.admission.admit(tenant.key_id, None, prompt_tokens, max_tokens, gone)
            except OpenAIError as exc:
                self._refused(counts, exc)
                return
            finally:
                for timer in limit:  # left the queue in time: the timer must not move the clock
                    self.clock.cancel(timer)
            counts.admitted += 1
            counts.queued += self.clock.now > arrived
            self.clock.call_at(self.clock.now, lambda: admitted(lease))

        task = asyncio.ensure_future(admit())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await self.settle()
        if task.done():
            return

        async def expire() -> None:
            if not task.done():
                left.set()
                await asyncio.wait({task})

        limit.append(self.clock.call_later(DEFAULT_TTL_S[tenant.band], expire))

    @staticmethod
    def _refused(counts: BandCounts, exc: OpenAIError) -> None:
        code = exc.info.code
        if exc.status == 499:  # its client left: here, only at the band's time limit
            counts.queue_ttl += 1
        elif code == "shed":
            counts.shed += 1
        elif code == "queue_full":
            counts.queue_full += 1
        elif code == "queue_ttl":
            counts.queue_ttl += 1
        else:
            counts.rate_limited += 1

    @property
    def waiting(self) -> int:
        """Requests in the admission queue (their tasks not done)."""
        return sum(not t.done() for t in self._tasks)

    def kick(self) -> None:
        """A poll refreshed the engines' loads: admit what now fits."""
        self.admission.kick()

    async def settle(self) -> None:
        """Run the admission tasks that can run (woken, or new) until each is done or waits in the queue."""
        for _ in range(_SETTLE_ROUNDS):
            running = sum(not t.done() for t in self._tasks)
            if running <= len(self.admission.flow.queue) and not self.admission.background:
                return
            await asyncio.sleep(0)
        raise RuntimeError("the admission tasks did not settle")

    def report(self) -> dict[str, BandCounts]:
        """Counts per band that saw requests."""
        return {band: c for band, c in self.counts.items() if c.requests}
