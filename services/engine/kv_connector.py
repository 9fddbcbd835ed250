"""KVConnector: what an engine role does with remote KV (prefill leases blocks, decode pulls them).

Pure bookkeeping around a transfer backend (NixlTransfer): the scheduler asks it to hold finished
prefills' blocks under a lease and to start/poll block loads for decode requests. No torch here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.kv_transfer import DEFAULT_LEASE_S, KVTransferParams

log = logging.getLogger(__name__)

Role = Literal["both", "prefill", "decode"]
_ABORT = b"abort:"


@dataclass
class _Load:
    request_id: str
    handle: Any
    num_blocks: int
    params: KVTransferParams


@dataclass
class TransferStats:
    """Counters for /metrics: blocks moved by (direction, path) and failures by reason."""

    blocks: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)


class KVConnector:
    """Role-specific KV movement. ``transfer`` is a NixlTransfer (or None when NIXL is unavailable)."""

    def __init__(self, role: Role, transfer: Any | None, host: str, port: int, block_size: int,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.role, self.transfer = role, transfer
        self.host, self.port, self.block_size, self.lease_s = host, port, block_size, lease_s
        self.engine_id = transfer.engine_id if transfer is not None else f"{host}:{port}"
        self.stats = TransferStats()
        self._leases: dict[str, tuple[float, int]] = {}  # request id -> (monotonic expiry, blocks)
        self._loads: dict[str, _Load] = {}

    # ------------------------------------------------------------------ prefill side
    def hold(self, request_id: str, block_ids: list[int], block_hashes: list[bytes]) -> KVTransferParams:
        """Lease the prompt's full blocks for a decode engine; returns the response's kv_transfer_params."""
        if block_ids and self.transfer is not None:
            self._leases[request_id] = (time.monotonic() + self.lease_s, len(block_ids))
        return KVTransferParams.for_remote_decode(
            engine_id=self.engine_id, host=self.host, port=self.port, request_id=request_id, block_ids=block_ids,
            block_hashes=block_hashes, block_size=self.block_size, lease_s=self.lease_s,
        )

    def released_leases(self) -> list[str]:
        """Leases to free now: decode read them (or aborted), or they expired."""
        done: list[str] = []
        if self.transfer is not None and self._leases:
            for _peer, msg in self.transfer.get_notifications():
                rid = msg.removeprefix(_ABORT).decode(errors="replace")
                if rid in self._leases:
                    _, n_blocks = self._leases.pop(rid)
                    if not msg.startswith(_ABORT):
                        self.stats.blocks["sent", "nixl"] += n_blocks
                    done.append(rid)
        now = time.monotonic()
        for rid, (expiry, _) in list(self._leases.items()):
            if now >= expiry:
                del self._leases[rid]
                self.stats.failures["lease_unread"] += 1  # prefill side: decode never read the blocks
                log.warning("KV lease of %s expired after %.0fs without a decode read; freeing its blocks", rid,
                            self.lease_s)
                done.append(rid)
        return done

    # ------------------------------------------------------------------ decode side
    def start_load(self, request_id: str, params: KVTransferParams, remote_ids: list[int],
                   local_ids: list[int]) -> bool:
        """Begin pulling ``remote_ids`` into ``local_ids``; False (and counted) when it cannot start."""
        if self.transfer is None or not self.transfer.has_peer(params.remote_engine_id or ""):
            self.record_failure("no_transfer_path" if self.transfer is None else "unknown_peer", request_id)
            return False
        if params.lease_expired():
            self.record_failure("lease_expired", request_id)
            return False
        notify = (params.remote_request_id or "").encode()
        handle = self.transfer.read_blocks(params.remote_engine_id, remote_ids, local_ids, notify)
        self._loads[request_id] = _Load(request_id, handle, len(local_ids), params)
        return True

    def finished_loads(self) -> list[tuple[str, bool]]:
        """(request id, succeeded) for every load that completed since the last call."""
        out = []
        for rid, load in list(self._loads.items()):
            state = self.transfer.poll(load.handle).name  # TransferState: DONE | PENDING | ERROR
            if state == "PENDING":
                continue
            del self._loads[rid]
            ok = state == "DONE"
            if ok:
                self.stats.blocks["received", "nixl"] += load.num_blocks
            else:
                self.record_failure("transfer_error", rid, load.handle.error)
            out.append((rid, ok))
        return out

    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def release_remote(self, params: KVTransferParams) -> None:
        """Tell prefill to free a lease we will not read (local hit covered it, or the request ended)."""
        if self.transfer is None or not params.remote_request_id or not params.remote_engine_id:
            return
        try:
            if self.transfer.has_peer(params.remote_engine_id):
                self.transfer.send_notification(params.remote_engine_id, _ABORT + params.remote_request_id.encode())
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.info("could not release lease %s early: %s", params.remote_request_id, exc)

    def record_failure(self, reason: str, request_id: str, detail: str | None = None) -> None:
        self.stats.failures[reason] += 1
        log.warning("KV transfer for %s failed (%s)%s; the prompt is recomputed locally (or fetched from the "
                    "kvstore when one is configured)", request_id, reason, f": {detail}" if detail else "")
