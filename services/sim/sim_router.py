"""SimRouter: the router's decision path (index lookup, RequestContext, Scheduler, routed hints), unchanged."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.kv.prefix_index import AsyncPrefixIndex, PrefixMatch
from services.router.scheduling import Endpoint, RequestContext, RouteDecision, Scheduler, SchedulingConfig


@dataclass
class RouterStats:
    """Wall-clock cost of the decisions (real CPU and real Redis round trips, not virtual time)."""

    decisions: int = 0
    no_endpoint: int = 0
    disaggregated: int = 0
    predicted_cached_tokens: int = 0
    prompt_tokens: int = 0
    cpu_s: float = 0.0
    lookup_s: list[float] = field(default_factory=list)


class SimRouter:
    """Does what ``RouterState.context`` + ``PDFlow.run``'s pick + ``RouterState.note_route`` do per request.

    The endpoints are the snapshot the router's poller would hold: refreshed every ``poll_interval_s``
    of virtual time from the engines' load, so the router routes on stale load as the real one does.
    """

    def __init__(
        self,
        scheduling: SchedulingConfig,
        index: AsyncPrefixIndex | None,
        block_size: int,
        endpoints: Callable[[], Sequence[Endpoint]],
        seed: int,
    ) -> None:
        self.scheduler = Scheduler(scheduling, random.Random(seed))
        self.index = index
        self.block_size = block_size
        self.endpoints = endpoints
        self.stats = RouterStats()

    async def context(self, prompt_tokens: int, block_hashes: Sequence[bytes]) -> RequestContext:
        if self.index is None or not block_hashes:
            none_found: dict[str, PrefixMatch] | None = {} if self.index is not None else None
            return RequestContext(prompt_tokens, self.block_size, none_found)
        t0 = time.perf_counter()
        matches = await self.index.lookup(block_hashes)
        self.stats.lookup_s.append(time.perf_counter() - t0)
        return RequestContext.from_lookup(prompt_tokens, self.block_size, matches)

    async def route(self, prompt_tokens: int, block_hashes: Sequence[bytes]) -> RouteDecision | None:
        """The route of one request (``None``: no endpoint), with the routed hint written as the router does."""
        cpu0 = time.process_time()
        ctx = await self.context(prompt_tokens, block_hashes)
        decision = self.scheduler.schedule(self.endpoints(), ctx)
        s = self.stats
        if decision is None:
            s.no_endpoint += 1
        else:
            s.decisions += 1
            s.disaggregated += decision.disaggregated
            s.prompt_tokens += prompt_tokens
            s.predicted_cached_tokens += decision.cached_tokens
            if self.index is not None and block_hashes:
                for endpoint in (decision.decode, decision.prefill):
                    match = ctx.match(endpoint) if endpoint is not None else None
                    if match is not None:
                        await self.index.note_routed(match.engine_id, block_hashes)
        s.cpu_s += time.process_time() - cpu0
        return decision
