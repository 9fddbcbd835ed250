"""HostKVTier: an engine's own second KV tier in host memory: block copies by hash, moved off the step, evicted
by a pluggable policy (LRU, or ARC: eviction_policy.py); with a local-disk tier behind it, the blocks it
evicts are demoted to disk and found there later.

Its budget is separate from the primary KV pool's (on a CPU engine both are RAM; on a GPU the tier is
pinned host memory). Stores and loads are jobs for one worker thread through a bounded queue: a store
that finds the queue full is dropped (counted), never waited for, so the engine's step never stalls on
the tier. The engine thread only looks hashes up and enqueues; the worker copies block bytes between the
KV cache and the tier's slots and reports finished jobs, which the connector polls each step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.kv_transfer.disk_tier import DiskKVTier
from services.engine.kv_transfer.eviction_policy import make_policy
from services.engine.kv_transfer.tier_log import TierLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierJob:
    """Copy ``blocks`` of the KV cache to (``store``) or from the tier's slots, then (loads) from the disk
    files of ``disk_hashes``, for ``request_id``; a demotion (no request) writes slots to disk files."""

    request_id: str
    store: bool
    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...]  # a store's (or demotion's) block hashes (a load's slots are indexed)
    ready: torch.cuda.Event | None = None  # a GPU engine's step that wrote the blocks (stores)
    disk_hashes: tuple[bytes, ...] = ()  # a load's blocks after its slots' ones, read from disk
    demote: bool = False
    queued: float = 0.0  # time.monotonic() when a load was submitted (its latency, for /metrics)


class HostKVTier:
    """``num_slots`` blocks of host memory shaped like the KV cache's blocks, indexed by block hash."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_slots: int,
        queue_depth: int = 64,
        disk: DiskKVTier | None = None,
        policy: str = "lru",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_cpu_bytes: holds no block ({num_slots} slots)")
        self.kv_cache, self.disk = kv_cache, disk
        self._demotions: list[tuple[bytes, int]] = []  # slots evicted to disk, written before their reuse
        self.log = TierLog("cpu")  # what the tier holds, as it changes (the KV events of tier "cpu")
        pin = kv_cache.device.type == "cuda"
        self.slots = torch.empty(
            (num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device="cpu", pin_memory=pin
        )  # host memory on purpose: the tier's whole point
        self.index: dict[bytes, int] = {}  # hash -> slot
        self.policy = make_policy(policy, num_slots)  # which held block a store evicts
        self.free = list(range(num_slots - 1, -1, -1))
        self.busy: dict[int, int] = {}  # slot -> jobs reading or writing it (never reused meanwhile)
        self._lock = threading.Lock()
        self._jobs: queue.Queue[TierJob | None] = queue.Queue(maxsize=queue_depth)
        self._done: queue.SimpleQueue[tuple[TierJob, bool]] = queue.SimpleQueue()
        self.stored = self.loaded = self.loaded_disk = self.dropped = self.evicted = self.demoted = 0
        self._worker = threading.Thread(target=self._work, name="kvferry-host-tier", daemon=True)
        self._worker.start()

    def on_disk(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading ``hashes`` the disk tier holds (0 without one)."""
        return self.disk.leading(list(hashes)) if self.disk is not None else 0

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the leading ``hashes`` the tier holds, in order (stops at the first miss), pinned:
        they are not reused until ``unpin`` or the load of them finishes."""
        found: list[int] = []
        with self._lock:
            for h in hashes:
                slot = self.index.get(h)
                if slot is None:
                    break
                self.policy.hit(h)
                found.append(slot)
            for slot in found:
                self.busy[slot] = self.busy.get(slot, 0) + 1
        return found

    def unpin(self, slots: Sequence[int]) -> None:
        """Slots a lookup pinned that will not be loaded after all."""
        with self._lock:
            for slot in slots:
                left = self.busy[slot] - 1
                if left:
                    self.busy[slot] = left
                else:
                    del self.busy[slot]

    def load(
        self, request_id: str, blocks: Sequence[int], slots: Sequence[int], disk_hashes: Sequence[bytes] = ()
    ) -> bool:
        """Copy pinned ``slots``, then the disk files of ``disk_hashes``, into the KV cache's ``blocks`` off
        the engine thread (unpinned when done); False (and unpinned) if the queue is full."""
        job = TierJob(
            request_id,
            False,
            tuple(blocks),
            tuple(slots),
            (),
            disk_hashes=tuple(disk_hashes),
            queued=time.monotonic(),
        )
        if self._submit(job):
            return True
        self.unpin(slots)
        return False

    def store(self, request_id: str, blocks: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """Copy ``blocks`` (full blocks with these hashes, in prompt order) into the tier; blocks it holds
        already are skipped, and those past the slots that can be freed are dropped (counted). False when
        nothing is stored (all held, no slot, or the queue full)."""
        with self._lock:
            todo = [(b, h) for b, h in zip(blocks, hashes, strict=True) if h not in self.index]
            slots: list[int] = []
            while len(slots) < len(todo) and (slot := self._take_slot(todo[len(slots)][1])) is not None:
                slots.append(slot)
            demoted, self._demotions = self._demotions, []
        if demoted:  # ahead of the store that reuses their slots (one worker, first in first out)
            self._submit(
                TierJob("", True, (), tuple(s for _, s in demoted), tuple(h for h, _ in demoted), demote=True)
            )
        if len(slots) < len(todo):  # the leading blocks that fit are kept (a prefix), the rest dropped
            self.dropped += 1
            todo = todo[: len(slots)]
        if not todo:
            return False
        ready = None
        if self.kv_cache.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        job = TierJob(
            request_id, True, tuple(b for b, _ in todo), tuple(slots), tuple(h for _, h in todo), ready
        )
        if not self._submit(job):
            self._release(slots)
            self.dropped += 1
            return False
        return True

    def finished(self) -> list[tuple[TierJob, bool]]:
        """Jobs done since the last call, with whether each succeeded."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    @property
    def used(self) -> int:
        """Blocks the tier holds."""
        return len(self.index)

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=5)

    def _submit(self, job: TierJob) -> bool:
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _take_slot(self, incoming: bytes) -> int | None:
        """A free slot, else the slot of the block the policy evicts among those no job is using; lock held."""
        if self.free:
            return self.free.pop()
        h = self.policy.evict(lambda key: self.index[key] in self.busy, incoming)
        if h is None:
            return None
        slot = self.index.pop(h)
        self.evicted += 1
        self.log.removed((h,))
        if self.disk is not None:
            self._demotions.append((h, slot))
        return slot

    def _release(self, slots: Sequence[int]) -> None:
        with self._lock:
            self.free.extend(slots)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            ok = True
            try:
                self._copy(job)
            except Exception:  # noqa: BLE001 - a failed copy is reported; the request recomputes
                what = "store" if job.store else "load"
                log.exception("host KV tier: %s of %d blocks failed", what, len(job.blocks))
                ok = False
            if job.demote:
                self._done.put((job, ok))
                continue
            with self._lock:
                if job.store and ok:
                    for h, slot in zip(job.hashes, job.slots, strict=True):
                        self.index[h] = slot
                        self.policy.admit(h)
                    self.log.stored(job.hashes)
                elif job.store:
                    self.free.extend(job.slots)
            if not job.store:
                self.unpin(job.slots)
            if ok:
                if job.store:
                    self.stored += len(job.blocks)
                else:
                    self.loaded += len(job.slots)
                    self.loaded_disk += len(job.disk_hashes)
            self._done.put((job, ok))

    def _copy(self, job: TierJob) -> None:
        if job.demote:
            self._demote(job)
            return
        blocks = torch.tensor(job.blocks, dtype=torch.long, device=self.kv_cache.device)
        n = len(job.slots)
        if job.store:
            if job.ready is not None:
                job.ready.synchronize()
            self.slots[torch.tensor(job.slots, dtype=torch.long, device="cpu")] = self.kv_cache.index_select(
                0, blocks
            ).to("cpu")
            return
        parts = (
            [self.slots.index_select(0, torch.tensor(job.slots, dtype=torch.long, device="cpu"))] if n else []
        )
        parts += [self._from_disk(h) for h in job.disk_hashes]
        data = torch.cat(parts).to(self.kv_cache.device, non_blocking=True)
        self.kv_cache.index_copy_(0, blocks, data)
        if self.kv_cache.device.type == "cuda":
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def _demote(self, job: TierJob) -> None:
        """Evicted slots' blocks written to the disk tier (before the slots are reused)."""
        assert self.disk is not None
        for h, slot in zip(job.hashes, job.slots, strict=True):
            self.disk.write(h, self.slots[slot].contiguous().view(torch.uint8).numpy().tobytes())
            self.demoted += 1

    def _from_disk(self, block_hash: bytes) -> torch.Tensor:
        """One block read from the disk tier, shaped as a slot (RuntimeError when it cannot be served)."""
        assert self.disk is not None
        payload = self.disk.read(block_hash)
        if payload is None:
            raise RuntimeError(f"disk KV tier: block {block_hash.hex()[:12]} is gone or corrupt")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw.view(self.slots.dtype).view(1, *self.slots.shape[1:])
