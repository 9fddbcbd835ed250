"""SimKVStoreConnector: an engine's kvstore tier: fetch a missing prefix, offload finished prompts, timed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import Match
from services.engine.core.request import Request
from services.sim.sim_kvstore import SimKVStore
from services.sim.timed_loads import TimedLoads
from services.sim.virtual_clock import VirtualClock


class SimKVStoreConnector(TimedLoads):
    """The engine's kvstore connector (``services.engine.kv_transfer.kvstore_connector``) on a virtual clock.

    As the real one: a request whose prompt is not all in the local cache is looked up once (here the
    answer is immediate); the leading blocks found load asynchronously into freshly allocated blocks
    (``blocks x s_per_block``; the scheduler parks the request in WAITING_FOR_REMOTE_KV meanwhile); a
    finished request's full prompt blocks that it computed itself are offloaded (``offload=False`` on
    decode: prefill offloaded the prompt).
    """

    def __init__(
        self,
        store: SimKVStore,
        clock: VirtualClock,
        s_per_block: float,
        block_size: int,
        wake: Callable[[], None],
        offload: bool = True,
    ) -> None:
        super().__init__(clock, wake)
        self.store, self.s_per_block = store, s_per_block
        self.block_size, self.offload = block_size, offload
        self._answers: dict[str, tuple[int, int]] = {}  # request id -> (first block asked, blocks found)
        self._checked: set[str] = set()  # asked once per request: never again (preemption)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        rid, bs = request.request_id, self.block_size
        if rid in self._checked:
            return 0, False
        if rid not in self._answers:
            first, last = num_local_computed // bs, (request.num_tokens - 1) // bs
            if first >= last:
                return 0, False
            self._answers[rid] = (first, self.store.match(request.block_hashes[first:last]))
        first, found = self._answers[rid]
        skip = num_local_computed // bs - first
        if skip < 0 or skip >= found:  # nothing found, or the local hit grew past it meanwhile
            del self._answers[rid]
            self._checked.add(rid)
            return 0, False
        return min((found - skip) * bs, request.num_tokens - 1 - num_local_computed), True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        rid = request.request_id
        del self._answers[rid]
        self._checked.add(rid)
        blocks = -(-num_external // self.block_size)
        self.start_load(rid, blocks, self.s_per_block, "received", "kvstore")

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._checked.discard(rid)
        self._answers.pop(rid, None)
        self.forget(rid)
        if self.offload and request.status.completed:
            bs = self.block_size
            first = max(request.num_cached_tokens, 0) // bs
            last = min(request.num_prompt_tokens // bs, len(request.block_hashes), len(block_ids))
            if first < last:
                self.store.put(request.block_hashes[first:last])
                self._stats.add_blocks("sent", "kvstore", last - first)
        return False, None
