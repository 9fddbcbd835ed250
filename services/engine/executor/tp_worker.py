"""The process of one parallel rank > 0: joins its groups, builds its Worker as rank 0 does, runs rank 0's steps.

Every rank runs the whole step (inputs, forward, sampling from the all-gathered logits) on the same
scheduler output, so each keeps the same request state without tokens being sent back; rank 0 checks
that the tokens agree. The worker exits when its pipe closes (the engine is gone) or on STOP.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from services.engine.executor.worker_messages import (
    STOP,
    KVCacheSize,
    LoadMemory,
    LoRAUpdate,
    LoRAUpdated,
    Ready,
    Step,
    StepDone,
    WorkerSpec,
)
from services.engine.kv_transfer.rank_transfer import start_rank_transfer
from services.engine.worker.parallel.groups import ParallelGroups
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.worker import Worker, rank_device

log = logging.getLogger(__name__)


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where there is no procfs."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _build_worker(spec: WorkerSpec, conn: Connection) -> tuple[Worker, LoadMemory]:
    """This rank's worker, built as rank 0 builds its own: groups joined, shard loaded, runner built on the
    KV cache size rank 0 sends."""
    plan = spec.plan
    device = rank_device(plan.config.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = TPGroup.store(spec.size, spec.timeout_s, port=spec.store_port)
    groups = ParallelGroups.join(
        store, spec.rank, plan.config.tensor_parallel_size, plan.config.pipeline_parallel_size,
        plan.model_config.num_hidden_layers, device.type == "cuda", spec.timeout_s,
    )  # fmt: skip
    before = status_bytes("VmRSS")
    worker = Worker.load(plan, groups, device)
    memory = LoadMemory(before, status_bytes("VmHWM"))
    size = conn.recv()
    if not isinstance(size, KVCacheSize):
        raise RuntimeError(f"expected the KV cache size, got {type(size).__name__}")
    worker.build_runner(size.num_blocks)
    return worker, memory


def _update_lora(worker: Worker, msg: LoRAUpdate) -> LoRAUpdated:
    try:
        worker.update_lora(msg.name, msg.path)
    except (ValueError, KeyError, OSError) as exc:
        return LoRAUpdated(f"{type(exc).__name__}: {exc}")
    return LoRAUpdated()


def worker_main(spec: WorkerSpec, conn: Connection, kv_conn: Connection) -> None:
    """Entry point of a spawned rank: build, say Ready, then run steps until told to stop (``kv_conn``:
    rank 0's calls on this rank's NIXL agent, answered on a thread of their own)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    try:
        worker, memory = _build_worker(spec, conn)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails loudly
        log.exception("tensor-parallel rank %d could not start", spec.rank)
        conn.send(Ready(error=f"{type(exc).__name__}: {exc}"))
        return
    assert worker.runner is not None
    runner = worker.runner
    start_rank_transfer(kv_conn, runner.kv_cache)
    conn.send(Ready(memory=memory))
    try:
        while True:
            msg = conn.recv()
            if msg == STOP:
                break
            if isinstance(msg, LoRAUpdate):
                conn.send(_update_lora(worker, msg))
                continue
            if not isinstance(msg, Step):
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
            runner.eos_ids = msg.eos_ids
            out = runner.execute(msg.sched, msg.constraints)
            conn.send(StepDone(out.sampled_token_ids, bool(out.failed_req_ids)))
    except EOFError:
        log.info("tensor-parallel rank %d: the engine is gone; exiting", spec.rank)
