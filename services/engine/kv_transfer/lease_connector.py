"""LeaseConnector: a finished prefill (or a decode request migrating off a draining engine) keeps its full
blocks under a lease until the next decode has READ them."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from services.common.kv.kv_transfer import DEFAULT_LEASE_S, KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request
from services.engine.kv_transfer.nixl_transfer import BlockTransfer

log = logging.getLogger(__name__)

ABORT_PREFIX = b"abort:"  # decode's notification that it will not read a lease (see the pull connector)


class LeaseSettings(BaseModel):
    """Where other engines reach this one (its side channel) and how long leased blocks wait for them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"  # advertised in kv_transfer_params (remote_host)
    port: int = Field(8000, ge=1, le=65535)
    lease_s: float = Field(DEFAULT_LEASE_S, gt=0)


class LeaseConnector:
    """Answers ``do_remote_decode`` requests with where their blocks are; frees them on decode's word or expiry.

    Without NIXL (``transfer`` None) the params still go out, but nothing is held: decode then finds
    the prompt in the kvstore (prefill offloads it there) or recomputes it.
    """

    def __init__(
        self,
        transfer: BlockTransfer | None,
        host: str,
        port: int,
        block_size: int,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.transfer, self.host, self.port = transfer, host, port
        self.block_size, self.lease_s = block_size, lease_s
        self.engine_id = transfer.engine_id if transfer is not None else f"{host}:{port}"
        self._stats = TransferStats()
        self._leases: dict[str, tuple[float, int]] = {}  # request id -> (monotonic expiry, blocks)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        return 0, False  # a prefill engine computes prompts; it never loads them

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        return None

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Lease the prompt's full blocks of a completed ``do_remote_decode`` request, or every computed full
        block of a request migrating off this draining engine (its handshake goes inline: the HTTP side
        channel closes while the engine drains)."""
        if request.migrating_out:
            num_tokens, handshake = request.num_computed_tokens, self._handshake()
        elif request.keeps_kv_for_decode and request.status.completed:
            num_tokens, handshake = request.num_prompt_tokens, None
        else:
            return False, None
        n_full = min(num_tokens // self.block_size, len(request.block_hashes), len(block_ids))
        leased = list(block_ids[:n_full])
        params = KVTransferParams.for_remote_decode(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=request.request_id,
            block_ids=leased,
            block_hashes=request.block_hashes[:n_full],
            block_size=self.block_size,
            lease_s=self.lease_s,
            lora_name=request.lora_name,
            handshake=handshake,
        )
        if not leased or self.transfer is None:  # nothing to READ over NIXL
            return False, params
        self._leases[request.request_id] = (time.monotonic() + self.lease_s, len(leased))
        return True, params

    def lease_export(
        self, lease_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], lora_name: str | None
    ) -> KVTransferParams:
        """Lease blocks the scheduler pinned for a peer's prefix pull (``/kv/export``); engine thread only.
        The handshake goes inline: the reader needs no second call to this engine."""
        if self.transfer is None:
            raise RuntimeError("lease_export without a NIXL agent")
        params = KVTransferParams.for_remote_decode(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=lease_id,
            block_ids=list(block_ids),
            block_hashes=list(block_hashes),
            block_size=self.block_size,
            lease_s=self.lease_s,
            lora_name=lora_name,
            handshake=self._handshake(),
        )
        self._leases[lease_id] = (time.monotonic() + self.lease_s, len(block_ids))
        return params

    @property
    def num_leases(self) -> int:
        """Leases not yet read, released or expired (a draining engine waits for them before it exits)."""
        return len(self._leases)

    def _handshake(self) -> str | None:
        return self.transfer.handshake_json() if self.transfer is not None else None

    def get_finished(self) -> FinishedTransfers:
        """Leases to free now: decode read them (or said it will not), or they expired unread."""
        if not self._leases:
            return FinishedTransfers()
        done: set[str] = set()
        for _peer, msg in self.transfer.get_notifications() if self.transfer is not None else ():
            rid = msg.removeprefix(ABORT_PREFIX).decode(errors="replace")
            if rid in self._leases:
                _, n_blocks = self._leases.pop(rid)
                if not msg.startswith(ABORT_PREFIX):
                    self._stats.add_blocks("sent", "nixl", n_blocks)
                done.add(rid)
        now = time.monotonic()
        for rid, (expiry, _) in list(self._leases.items()):
            if now >= expiry:
                del self._leases[rid]
                self._stats.add_failure("lease_unread")  # decode never read the blocks
                log.warning(
                    "KV lease of %s expired after %.0fs without a decode read; freeing its blocks",
                    rid,
                    self.lease_s,
                )
                done.add(rid)
        return FinishedTransfers(sent=frozenset(done)) if done else FinishedTransfers()

    def stats(self) -> TransferStats:
        return self._stats

    def close(self) -> None:
        return None
