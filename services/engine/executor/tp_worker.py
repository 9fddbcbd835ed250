"""The process of one parallel rank > 0: joins its groups, loads its shard or stage, runs rank 0's steps.

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
    Ready,
    Step,
    StepDone,
    WorkerSpec,
)
from services.engine.kv_transfer.rank_transfer import start_rank_transfer
from services.engine.worker.attention import select_backend
from services.engine.worker.loader.model_loader import load_model, load_model_config
from services.engine.worker.model_runner import ModelRunner, kv_cache_shape
from services.engine.worker.parallel.groups import ParallelGroups, rank_kv_config
from services.engine.worker.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (one per rank), else the CPU."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank)
    return torch.device("cpu")


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where there is no procfs."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _build_runner(spec: WorkerSpec, conn: Connection) -> tuple[ModelRunner, LoadMemory]:
    device = rank_device(spec.config.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = TPGroup.store(spec.size, spec.timeout_s, port=spec.store_port)
    cfg = load_model_config(spec.config.model)
    groups = ParallelGroups.join(
        store, spec.rank, spec.config.tensor_parallel_size, spec.config.pipeline_parallel_size,
        cfg.num_hidden_layers, device.type == "cuda", spec.timeout_s,
    )  # fmt: skip
    dtype = getattr(torch, spec.dtype)
    before = status_bytes("VmRSS")
    model = load_model(spec.config.model, cfg, dtype, device, spec.max_model_len, tp=groups.tp, pp=groups.pp)
    memory = LoadMemory(before, status_bytes("VmHWM"))
    size = conn.recv()
    if not isinstance(size, KVCacheSize):
        raise RuntimeError(f"expected the KV cache size, got {type(size).__name__}")
    shard = rank_kv_config(cfg, groups)  # this rank's KV heads and layers
    shape = kv_cache_shape(shard, size.num_blocks, spec.config.block_size)
    kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    backend = select_backend(device, spec.backend)
    runner = ModelRunner(
        model,
        shard,
        kv_cache,
        spec.config.block_size,
        backend,
        device,
        cfg.eos_token_ids,
        seed=spec.config.seed,
    )
    return runner, memory


def worker_main(spec: WorkerSpec, conn: Connection, kv_conn: Connection) -> None:
    """Entry point of a spawned rank: build, say Ready, then run steps until told to stop (``kv_conn``:
    rank 0's calls on this rank's NIXL agent, answered on a thread of their own)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    try:
        runner, memory = _build_runner(spec, conn)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails loudly
        log.exception("tensor-parallel rank %d could not start", spec.rank)
        conn.send(Ready(error=f"{type(exc).__name__}: {exc}"))
        return
    start_rank_transfer(kv_conn, runner.kv_cache)
    conn.send(Ready(memory=memory))
    try:
        while True:
            msg = conn.recv()
            if msg == STOP:
                break
            if not isinstance(msg, Step):
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
            runner.eos_ids = msg.eos_ids
            out = runner.execute(msg.sched, msg.constraints)
            conn.send(StepDone(out.sampled_token_ids, bool(out.failed_req_ids)))
    except EOFError:
        log.info("tensor-parallel rank %d: the engine is gone; exiting", spec.rank)
