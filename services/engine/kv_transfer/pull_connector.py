"""PullConnector: a decode request READs its prompt's blocks from the prefill engine named in its params."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.kv.kv_transfer import KVTransferError, KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request
from services.engine.kv_transfer.nixl_transfer import BlockTransfer, TransferHandle, TransferState

log = logging.getLogger(__name__)

ABORT_PREFIX = b"abort:"  # tells prefill to free a lease we will not read (its lease connector listens)


@dataclass
class _Load:
    handle: TransferHandle
    num_blocks: int


class PullConnector:
    """Checks prefill's hashes and lease, READs the blocks past the local hit, releases leases it skips.

    Every failure is counted by reason and logged, and the request falls through to the next connector
    (the kvstore) or is recomputed: never a silent wrong answer, never a hang.
    """

    def __init__(
        self, transfer: BlockTransfer | None, block_size: int, stats: TransferStats | None = None
    ) -> None:
        self.transfer, self.block_size = transfer, block_size
        self._stats = stats or TransferStats()
        self._matched: dict[str, tuple[KVTransferParams, int]] = {}  # request id -> (params, first block)
        self._loads: dict[str, _Load] = {}
        self._failed: set[str] = set()  # reads that could not start: reported at the next get_finished

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        params, bs = request.kv_transfer_params, self.block_size
        if params is None or not params.do_remote_prefill:
            return 0, False
        rid, n_remote = request.request_id, len(params.remote_block_ids)
        if params.hashes() != request.block_hashes[:n_remote]:
            self.record_failure("hash_mismatch", rid, "prefill's block hashes differ from this prompt's")
            return self._drop(request)
        loadable = min(n_remote * bs, request.num_tokens - 1)
        if loadable <= num_local_computed:  # the local prefix hit covers prefill's blocks
            return self._drop(request)
        if self.transfer is None or not self.transfer.has_peer(params.remote_engine_id or ""):
            self.record_failure("no_transfer_path" if self.transfer is None else "unknown_peer", rid)
            return self._consume(request)
        if params.lease_expired():
            self.record_failure("lease_expired", rid)
            return self._consume(request)
        self._matched[rid] = (params, num_local_computed // bs)  # (blocks may be short: asked again then)
        return loadable - num_local_computed, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        """READ prefill's blocks past the local hit into ours; the read's end is reported by get_finished."""
        rid = request.request_id
        params, first = self._matched.pop(rid)
        request.kv_transfer_params = None  # consumed: a preempted request recomputes
        local = list(block_ids[first:])
        remote = params.remote_block_ids[first : first + len(local)]
        try:
            if self.transfer is None or params.remote_engine_id is None:
                raise KVTransferError("no NIXL agent or no peer to read from")
            handle = self.transfer.read_blocks(
                params.remote_engine_id,
                remote,
                local[: len(remote)],
                (params.remote_request_id or "").encode(),
            )
        except KVTransferError as exc:
            self.record_failure("transfer_error", rid, str(exc))
            self._failed.add(rid)
            return
        self._loads[rid] = _Load(handle, len(remote))

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        if rid in self._loads:
            return True, None  # the READ still writes into its blocks: free them when it ends
        params = request.kv_transfer_params
        if params is not None and params.do_remote_prefill:
            self.release(params)  # never read: let prefill free its lease now
        return False, None

    def get_finished(self) -> FinishedTransfers:
        received: set[str] = set()
        failed, self._failed = self._failed, set()
        for rid, load in list(self._loads.items()):
            state = self.transfer.poll(load.handle) if self.transfer is not None else TransferState.ERROR
            if state is TransferState.PENDING:
                continue
            del self._loads[rid]
            if state is TransferState.DONE:
                self._stats.add_blocks("received", "nixl", load.num_blocks)
                received.add(rid)
            else:
                self.record_failure("transfer_error", rid, load.handle.error)
                failed.add(rid)
        if not received and not failed:
            return FinishedTransfers()
        return FinishedTransfers(received=frozenset(received), failed=frozenset(failed))

    def stats(self) -> TransferStats:
        return self._stats

    def close(self) -> None:
        return None

    def release(self, params: KVTransferParams) -> None:
        """Tell prefill to free a lease we will not read (a local hit covered it, or the request ended)."""
        if self.transfer is None or not params.remote_request_id or not params.remote_engine_id:
            return
        try:
            if self.transfer.has_peer(params.remote_engine_id):
                self.transfer.send_notification(
                    params.remote_engine_id, ABORT_PREFIX + params.remote_request_id.encode()
                )
        except KVTransferError as exc:  # the lease expires anyway
            log.info("could not release lease %s early: %s", params.remote_request_id, exc)

    def record_refusal(self, reason: str, request_id: str, detail: str) -> None:
        """A request refused (409) for its remote KV: counted with the transfer failures, logged as an error."""
        self._stats.add_failure(reason)
        log.error("refusing remote KV for %s (%s): %s", request_id, reason, detail)

    def record_failure(self, reason: str, request_id: str, detail: str | None = None) -> None:
        self._stats.add_failure(reason)
        log.warning(
            "KV transfer for %s failed (%s)%s; the prompt is recomputed locally (or fetched from the "
            "kvstore when one is configured)",
            request_id,
            reason,
            f": {detail}" if detail else "",
        )

    def _drop(self, request: Request) -> Match:
        """Serve without prefill's blocks, and free its lease."""
        if request.kv_transfer_params is not None:
            self.release(request.kv_transfer_params)
        return self._consume(request)

    @staticmethod
    def _consume(request: Request) -> Match:
        request.kv_transfer_params = None
        return 0, False
