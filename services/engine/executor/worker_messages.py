"""The messages between the engine (rank 0) and its tensor-parallel worker processes, over local pipes."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.core.outputs import SchedulerOutput
from services.engine.worker.structured.manager import StepConstraints
from services.engine.worker.worker_plan import WorkerPlan


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot run another step."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join the group and build its shard (sent when it is spawned)."""

    plan: WorkerPlan  # what rank 0 builds, which this rank builds too (its shard)
    rank: int
    size: int
    store_port: int  # rank 0's TCP store on 127.0.0.1, where the ranks meet
    timeout_s: float  # for every collective: a stopped rank fails the step in this time, not never


@dataclass(frozen=True)
class KVCacheSize:
    """Rank 0's KV cache size, which every rank allocates (the block tables are the same on all)."""

    num_blocks: int


@dataclass(frozen=True)
class Step:
    """One step for every rank: the same scheduler output, constraints and stop tokens as rank 0's."""

    sched: SchedulerOutput
    constraints: StepConstraints | None
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoRAUpdate:
    """Load an adapter (``path``) or unload it (None) on a worker, as rank 0 just did."""

    name: str
    path: str | None


@dataclass(frozen=True)
class LoRAUpdated:
    """A worker's answer to LoRAUpdate (``error``: why it failed where rank 0 did not)."""

    error: str | None = None


@dataclass(frozen=True)
class StepDone:
    """A worker's answer: the tokens it sampled (they must equal rank 0's) or its error."""

    sampled: tuple[tuple[int, ...], ...]
    failed: bool


@dataclass(frozen=True)
class LoadMemory:
    """A worker's resident memory around loading its shard (bytes; /proc/self/status, Linux)."""

    before: int  # VmRSS once the groups were joined, before any weight was read
    peak: int  # VmHWM once the weights were loaded (before the KV cache)


@dataclass(frozen=True)
class Ready:
    """A worker loaded its shard and allocated its KV cache (``error``: why it could not)."""

    error: str | None = None
    memory: LoadMemory | None = None


STOP = "stop"
