"""SimPullConnector: a decode engine's KV pull from prefill, timed by the model's transfer time per block."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import Match
from services.engine.core.request import Request
from services.sim.timed_loads import TimedLoads
from services.sim.virtual_clock import VirtualClock


class SimPullConnector(TimedLoads):
    """The engine's KV-connector port for ``do_remote_prefill`` requests: the prompt (but its last token)
    arrives asynchronously after ``blocks x transfer_s_per_block`` virtual seconds; the scheduler parks
    the request in WAITING_FOR_REMOTE_KV meanwhile, exactly as with the NIXL pull."""

    def __init__(
        self, clock: VirtualClock, transfer_s_per_block: float, block_size: int, wake: Callable[[], None]
    ) -> None:
        super().__init__(clock, wake)
        self.transfer_s_per_block = transfer_s_per_block
        self.block_size = block_size

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return 0, False
        return max(request.num_prompt_tokens - 1 - num_local_computed, 0), True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        blocks = -(-num_external // self.block_size)
        self.start_load(request.request_id, blocks, self.transfer_s_per_block, "in", "sim")

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self.forget(request.request_id)
        return False, None
