"""ScriptedConnector: a KVConnector whose outcome per request is scripted, for model-free scheduler tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request


@dataclass
class Script:
    """What the connector does for one request."""

    external: int = 0  # tokens it can supply past the local hit (capped one short of the prompt)
    load_async: bool = False  # True: a load reported later by get_finished; False: done at alloc
    undecided: int = 0  # answer None (lookup in flight) this many times first
    late: int = 0  # an async load ends after this many get_finished calls
    fail: bool = False  # the async load ends in failure (never offered again)
    hold: int | None = None  # a completed request's blocks are kept for this many get_finished calls
    params: KVTransferParams | None = None  # answered by request_finished


@dataclass
class _Load:
    remaining: int
    fail: bool


@dataclass
class ScriptedConnector:
    """Follows ``scripts`` (by request id; unscripted requests get nothing) and records every call."""

    scripts: dict[str, Script] = field(default_factory=dict)
    allocs: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    loads: dict[str, _Load] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    spent: set[str] = field(default_factory=set)  # loaded or failed: never offered again
    asked: list[str] = field(default_factory=list)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        rid = request.request_id
        self.asked.append(rid)
        script = self.scripts.get(rid)
        if script is None or rid in self.spent:
            return 0, False
        if script.undecided > 0:
            script.undecided -= 1
            return None
        n = max(0, min(script.external, request.num_tokens - 1 - num_local_computed))
        return n, script.load_async

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        rid = request.request_id
        script = self.scripts[rid]
        self.allocs[rid] = (list(block_ids), num_external)
        self.spent.add(rid)
        if script.load_async:
            self.loads[rid] = _Load(script.late, script.fail)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self.finished.append(rid)
        script = self.scripts.get(rid)
        if rid in self.loads:
            return True, None  # the load still writes into its blocks
        if script is not None and script.hold is not None and request.status.completed:
            self.holds[rid] = script.hold
            return True, script.params
        return False, script.params if script is not None else None

    def get_finished(self) -> FinishedTransfers:
        received, failed, sent = set(), set(), set()
        for rid, load in list(self.loads.items()):
            if load.remaining > 0:
                load.remaining -= 1
                continue
            del self.loads[rid]
            (failed if load.fail else received).add(rid)
        for rid, left in list(self.holds.items()):
            if left > 0:
                self.holds[rid] = left - 1
            else:
                del self.holds[rid]
                sent.add(rid)
        return FinishedTransfers(frozenset(sent), frozenset(received), frozenset(failed))

    def stats(self) -> TransferStats:
        return TransferStats()

    def close(self) -> None:
        return None
