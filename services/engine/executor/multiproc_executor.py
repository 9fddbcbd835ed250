"""MultiprocExecutor: rank 0 in the engine process, one spawned worker process per other rank
(tensor_parallel_size x pipeline_parallel_size ranks; see ParallelGroups for the grid).

Every step's scheduler output goes to each worker over a local pipe (spawned children of this process:
nothing from the network is unpickled), all ranks run it in lockstep (their collectives meet), and
rank 0's output is the step's. A worker that dies, stops answering within the collective timeout, or
samples other tokens than rank 0 is fatal: ``WorkerDiedError``, and the engine stops serving.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from services.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from services.engine.executor.tp_worker import worker_main
from services.engine.executor.worker_messages import (
    STOP,
    KVCacheSize,
    LoadMemory,
    LoRAUpdate,
    LoRAUpdated,
    Ready,
    Step,
    StepDone,
    WorkerDiedError,
    WorkerSpec,
)
from services.engine.kv_transfer.rank_transfer import RankTransferClient
from services.engine.worker.parallel.groups import ParallelGroups
from services.engine.worker.parallel.pp_stage import PPStage
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.structured.manager import StepConstraints
from services.engine.worker.worker import Worker, rank_device
from services.engine.worker.worker_plan import WorkerPlan

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a stopped rank fails the engine in this time (gloo / NCCL timeout)
_START_TIMEOUT_S = 900.0  # loading a shard of a large checkpoint


class MultiprocExecutor:
    """Tensor and pipeline parallelism over ``size`` ranks: starts the workers and joins as rank 0."""

    def __init__(self, plan: WorkerPlan) -> None:
        config = plan.config
        self.size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.worker: Worker | None = None
        self.load_memory: dict[int, LoadMemory] = {}  # rank -> its resident memory around loading
        self.device = rank_device(config.device, 0)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
        store = TPGroup.store(self.size, COLLECTIVE_TIMEOUT_S)
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.kv_ranks: list[RankTransferClient] = []  # each worker's NIXL agent (P/D), rank order
        # ranks never talk to other pods: no pool secret
        rank_plan = replace(plan, config=config.model_copy(update={"pool_secret": None}))
        for rank in range(1, self.size):
            spec = WorkerSpec(rank_plan, rank, self.size, store.port, COLLECTIVE_TIMEOUT_S)
            parent, child = ctx.Pipe()
            kv_parent, kv_child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(spec, child, kv_child), name=f"kvferry-tp{rank}", daemon=True
            )
            proc.start()
            child.close()
            kv_child.close()
            self.procs.append(proc)
            self.conns.append(parent)
            self.kv_ranks.append(RankTransferClient(kv_parent, rank))
        self.groups = ParallelGroups.join(
            store, 0, config.tensor_parallel_size, config.pipeline_parallel_size,
            plan.model_config.num_hidden_layers,
            self.device.type == "cuda", COLLECTIVE_TIMEOUT_S,
        )  # fmt: skip
        self._store = store  # kept alive: the workers' store connections end at rank 0
        log.info("parallelism: %d ranks (tensor %d x pipeline %d, %s), worker pids %s", self.size,
                 config.tensor_parallel_size, config.pipeline_parallel_size,
                 "nccl" if self.device.type == "cuda" else "gloo", [p.pid for p in self.procs])  # fmt: skip

    @property
    def group(self) -> TPGroup | None:
        """Rank 0's tensor-parallel group (None without tensor parallelism)."""
        return self.groups.tp

    @property
    def stage(self) -> PPStage | None:
        """Rank 0's pipeline stage, the first (None without pipeline parallelism)."""
        return self.groups.pp

    def attach(self, worker: Worker, num_blocks: int) -> None:
        """Rank 0's worker (its runner built); the workers allocate ``num_blocks`` KV blocks too and build
        their runners, then report Ready."""
        self.worker = worker
        for conn in self.conns:
            conn.send(KVCacheSize(num_blocks))
        for rank, conn in enumerate(self.conns, start=1):
            ready = self._recv(rank, conn, _START_TIMEOUT_S)
            if not isinstance(ready, Ready) or ready.error is not None:
                error = ready.error if isinstance(ready, Ready) else type(ready).__name__
                raise WorkerDiedError(f"tensor-parallel rank {rank} could not start: {error}")
            if ready.memory is not None:
                self.load_memory[rank] = ready.memory
                log.info("rank %d loaded its shard: resident %.0f MiB before, peak %.0f MiB", rank,
                         ready.memory.before / 2**20, ready.memory.peak / 2**20)  # fmt: skip

    def execute(
        self, sched: SchedulerOutput, constraints: StepConstraints | None = None
    ) -> ModelRunnerOutput:
        """One step on every rank; rank 0's output (the workers' tokens must be the same)."""
        assert self.worker is not None and self.worker.runner is not None, "attach() first"
        self._send(Step(sched, constraints, tuple(self.worker.runner.eos_ids)))
        out = self.worker.execute(sched, constraints)
        for rank, conn in enumerate(self.conns, start=1):
            done = self._recv(rank, conn, COLLECTIVE_TIMEOUT_S + 10)
            if not isinstance(done, StepDone):
                raise WorkerDiedError(f"tensor-parallel rank {rank} answered {type(done).__name__}")
            if not done.failed and not out.failed_req_ids and done.sampled != out.sampled_token_ids:
                raise WorkerDiedError(f"tensor-parallel rank {rank} sampled other tokens than rank 0")
        return out

    def update_lora(self, name: str, path: str | None) -> None:
        """Rank 0 first (its error is the caller's: nothing else changed), then every worker, in step."""
        assert self.worker is not None, "attach() first"
        self.worker.update_lora(name, path)
        self._send(LoRAUpdate(name, path))
        for rank, conn in enumerate(self.conns, start=1):
            done = self._recv(rank, conn, _START_TIMEOUT_S)
            if not isinstance(done, LoRAUpdated) or done.error is not None:
                error = done.error if isinstance(done, LoRAUpdated) else type(done).__name__
                raise WorkerDiedError(
                    f"tensor-parallel rank {rank} could not update LoRA adapter {name!r}: {error}"
                )

    def _send(self, msg: object) -> None:
        """The same message to every worker (WorkerDiedError when one is gone)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                raise WorkerDiedError(f"tensor-parallel rank {rank} is gone ({self._exit(rank)})") from exc

    def _recv(self, rank: int, conn: Connection, timeout: float) -> object:
        """The next message of a worker; WorkerDiedError if it exits or says nothing for ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not conn.poll(0.5):
            if not self.procs[rank - 1].is_alive():
                raise WorkerDiedError(f"tensor-parallel rank {rank} died ({self._exit(rank)})")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel rank {rank} did not answer within {timeout:.0f} s")
        try:
            return conn.recv()
        except (EOFError, ConnectionResetError) as exc:
            raise WorkerDiedError(f"tensor-parallel rank {rank} is gone ({self._exit(rank)})") from exc

    def _exit(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        proc.join(0.5)
        return f"pid {proc.pid}, exit code {proc.exitcode}"

    def shutdown(self) -> None:
        """Stop the workers (STOP, then terminate what is left) and leave the group."""
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(STOP)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
