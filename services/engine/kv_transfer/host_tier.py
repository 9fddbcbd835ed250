"""HostKVTier: an engine's own second KV tier in host memory: block copies by hash, LRU, moved off the step.

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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierJob:
    """Copy ``blocks`` of the KV cache to (``store``) or from the tier's slots, for ``request_id``."""

    request_id: str
    store: bool
    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...]  # a store's block hashes (a load's are already indexed)
    ready: torch.cuda.Event | None = None  # a GPU engine's step that wrote the blocks (stores)


class HostKVTier:
    """``num_slots`` blocks of host memory shaped like the KV cache's blocks, indexed by block hash."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, queue_depth: int = 64) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_cpu_bytes: holds no block ({num_slots} slots)")
        self.kv_cache = kv_cache
        pin = kv_cache.device.type == "cuda"
        self.slots = torch.empty((num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=pin)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.busy: dict[int, int] = {}  # slot -> jobs reading or writing it (never reused meanwhile)
        self._lock = threading.Lock()
        self._jobs: queue.Queue[TierJob | None] = queue.Queue(maxsize=queue_depth)
        self._done: queue.SimpleQueue[tuple[TierJob, bool]] = queue.SimpleQueue()
        self.stored = self.loaded = self.dropped = self.evicted = 0
        self._worker = threading.Thread(target=self._work, name="kvferry-host-tier", daemon=True)
        self._worker.start()

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the leading ``hashes`` the tier holds, in order (stops at the first miss), pinned:
        they are not reused until ``unpin`` or the load of them finishes."""
        found: list[int] = []
        with self._lock:
            for h in hashes:
                slot = self.index.get(h)
                if slot is None:
                    break
                self.index.move_to_end(h)
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

    def load(self, request_id: str, blocks: Sequence[int], slots: Sequence[int]) -> bool:
        """Copy pinned ``slots`` into the KV cache's ``blocks`` off the engine thread (unpinned when done);
        False (and unpinned) if the queue is full."""
        job = TierJob(request_id, False, tuple(blocks), tuple(slots), ())
        if self._submit(job):
            return True
        self.unpin(slots)
        return False

    def store(self, request_id: str, blocks: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """Copy ``blocks`` (full blocks with these hashes) into the tier; blocks it holds already are skipped.
        False (the store dropped, counted) when the queue is full or no slot can be freed."""
        with self._lock:
            todo = [(b, h) for b, h in zip(blocks, hashes, strict=True) if h not in self.index]
            slots = [s for s in (self._take_slot() for _ in todo) if s is not None]
        if len(slots) < len(todo):
            self._release(slots)
            self.dropped += 1
            return False
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

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one no job is using (its block evicted); lock held."""
        if self.free:
            return self.free.pop()
        for h, slot in self.index.items():
            if slot not in self.busy:
                del self.index[h]
                self.evicted += 1
                return slot
        return None

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
            with self._lock:
                if job.store and ok:
                    for h, slot in zip(job.hashes, job.slots, strict=True):
                        self.index[h] = slot
                elif job.store:
                    self.free.extend(job.slots)
            if not job.store:
                self.unpin(job.slots)
            if ok:
                if job.store:
                    self.stored += len(job.blocks)
                else:
                    self.loaded += len(job.blocks)
            self._done.put((job, ok))

    def _copy(self, job: TierJob) -> None:
        blocks = torch.tensor(job.blocks, dtype=torch.long, device=self.kv_cache.device)
        slots = torch.tensor(job.slots, dtype=torch.long)
        if job.store:
            if job.ready is not None:
                job.ready.synchronize()
            self.slots[slots] = self.kv_cache.index_select(0, blocks).to("cpu")
        else:
            data = self.slots.index_select(0, slots).to(self.kv_cache.device, non_blocking=True)
            self.kv_cache.index_copy_(0, blocks, data)
            if self.kv_cache.device.type == "cuda":
                torch.cuda.current_stream(self.kv_cache.device).synchronize()
