"""SimPullConnector: a decode engine's KV pull from prefill, timed by the model's transfer time per block."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request
from services.sim.virtual_clock import VirtualClock


class SimPullConnector:
    """The engine's KV-connector port for ``do_remote_prefill`` requests: the prompt (but its last token)
    arrives asynchronously after ``blocks x transfer_s_per_block`` virtual seconds; the scheduler parks
    the request in WAITING_FOR_REMOTE_KV meanwhile, exactly as with the NIXL pull."""

    def __init__(
        self, clock: VirtualClock, transfer_s_per_block: float, block_size: int, wake: Callable[[], None]
    ) -> None:
        self.clock = clock
        self.transfer_s_per_block = transfer_s_per_block
        self.block_size = block_size
        self.wake = wake
        self._loads: dict[str, float] = {}  # request id -> when its blocks have arrived
        self._stats = TransferStats()

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return 0, False
        return max(request.num_prompt_tokens - 1 - num_local_computed, 0), True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        blocks = -(-num_external // self.block_size)
        done = self.clock.now + blocks * self.transfer_s_per_block
        self._loads[request.request_id] = done
        self._stats.add_blocks("in", "sim", blocks)
        self.clock.call_at(done, self.wake)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._loads.pop(request.request_id, None)
        return False, None

    def get_finished(self) -> FinishedTransfers:
        now = self.clock.now
        done = frozenset(rid for rid, at in self._loads.items() if at <= now)
        for rid in done:
            del self._loads[rid]
        return FinishedTransfers(received=done) if done else FinishedTransfers()

    def stats(self) -> TransferStats:
        return self._stats

    def close(self) -> None:
        return None
