"""KVConnector: the scheduler's one port for KV that enters or leaves the engine (vLLM V1's verbs).

Implementations: the lease connector and the pull connector (services/engine/kv_transfer, composed by
the roles), the kvstore connector (services/engine/kv_transfer). ``MultiConnector`` asks its
members in order; ``NullConnector`` is an engine with no KV tier at all. Pure Python, no torch.

The protocol, as the scheduler uses it:
- ``get_num_new_matched_tokens(request, num_local)``: how many tokens past the local prefix hit this
  connector can supply, and whether they arrive asynchronously; ``None`` means "not known yet, ask
  again next step" (e.g. a lookup in flight). A connector never offers again what failed.
- ``update_state_after_alloc(request, block_ids, num_external)``: the blocks are allocated; start the
  load into them (a synchronous load is complete when this returns).
- ``request_finished(request, block_ids)``: the request ended; ``delay_free`` keeps its blocks until
  ``get_finished`` names it (a lease for decode, a read still writing into them); the params go back
  to the client (``kv_transfer_params`` of the response).
- ``get_finished()``: (sent, received, failed) request ids since the last call: blocks whose free
  was delayed may go, loads that completed, loads that failed (the scheduler recomputes, or asks the
  connectors after the failed one).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.latency_histogram import LatencyHistogram
from services.engine.core.request import Request

Match = tuple[int, bool]  # (num_external_tokens, load_async)


@dataclass
class TransferStats:
    """Counters for /metrics: blocks moved by (direction, path), failures by reason, and per KV tier the
    blocks it holds now and how long its loads took (thread-safe)."""

    blocks: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    held: Counter[str] = field(default_factory=Counter)  # tier -> blocks it holds (a gauge)
    loads: dict[str, LatencyHistogram] = field(default_factory=dict)  # tier -> load latency
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_blocks(self, direction: str, path: str, n: int) -> None:
        with self._lock:
            self.blocks[direction, path] += n

    def add_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def observe_load(self, tier: str, seconds: float) -> None:
        """A load from ``tier`` took ``seconds`` (from its lookup to the blocks being usable)."""
        with self._lock:
            self.loads.setdefault(tier, LatencyHistogram()).observe(seconds)

    def merge(self, other: TransferStats) -> None:
        """Add ``other``'s counts to this one."""
        with other._lock:
            blocks, failures, held = Counter(other.blocks), Counter(other.failures), Counter(other.held)
            loads = {t: LatencyHistogram(list(h.counts), h.total) for t, h in other.loads.items()}
        with self._lock:
            self.blocks.update(blocks)
            self.failures.update(failures)
            self.held.update(held)
            for tier, hist in loads.items():
                self.loads.setdefault(tier, LatencyHistogram()).merge(hist)


@dataclass(frozen=True)
class FinishedTransfers:
    """What ``get_finished`` reports: request ids whose delayed free may happen, loads done, loads failed."""

    sent: frozenset[str] = frozenset()
    received: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.sent or self.received or self.failed)


NOTHING_FINISHED = FinishedTransfers()


class KVConnector(Protocol):
    """The scheduler-side verbs every KV connector implements."""

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external: int
    ) -> None: ...

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]: ...

    def get_finished(self) -> FinishedTransfers: ...

    def stats(self) -> TransferStats:
        """Blocks moved and failures so far (a snapshot the caller may keep)."""
        ...

    def close(self) -> None: ...


class NullConnector:
    """No KV enters or leaves: every prompt is computed here."""

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        return None

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        return False, None

    def get_finished(self) -> FinishedTransfers:
        return NOTHING_FINISHED

    def stats(self) -> TransferStats:
        return TransferStats()

    def close(self) -> None:
        return None


class MultiConnector:
    """Members asked in order: the first with external tokens loads them; every member sees every finish."""

    def __init__(self, members: Iterable[KVConnector]) -> None:
        self.members: tuple[KVConnector, ...] = tuple(members)
        self._owner: dict[str, KVConnector] = {}  # request id -> the member loading its KV

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        for member in self.members:
            match = member.get_num_new_matched_tokens(request, num_local_computed)
            if match is None:
                return None
            if match[0] > 0:
                self._owner[request.request_id] = member
                return match
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        owner = self._owner.pop(request.request_id, None)
        if owner is not None:
            owner.update_state_after_alloc(request, block_ids, num_external)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._owner.pop(request.request_id, None)
        delay, params = False, None
        for member in self.members:
            member_delay, member_params = member.request_finished(request, block_ids)
            delay = delay or member_delay
            params = params if params is not None else member_params
        return delay, params

    def get_finished(self) -> FinishedTransfers:
        reports = [f for f in (m.get_finished() for m in self.members) if f]
        if not reports:
            return NOTHING_FINISHED
        return FinishedTransfers(
            frozenset().union(*(f.sent for f in reports)),
            frozenset().union(*(f.received for f in reports)),
            frozenset().union(*(f.failed for f in reports)),
        )

    def stats(self) -> TransferStats:
        total = TransferStats()
        for member in self.members:
            total.merge(member.stats())
        return total

    def close(self) -> None:
        for member in self.members:
            member.close()


def compose(members: Sequence[KVConnector]) -> KVConnector:
    """One connector for a list of them: Null for none, the member itself for one, else a Multi."""
    if not members:
        return NullConnector()
    return members[0] if len(members) == 1 else MultiConnector(members)
