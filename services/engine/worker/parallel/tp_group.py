"""TPGroup: this process's rank in the tensor-parallel group and the collectives the model layers call."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.engine.worker.model_config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of ``size`` in this engine's own process group (not torch's global default group, so
    one process can hold several engines): gloo on CPU, NCCL on CUDA."""

    rank: int
    size: int
    pg: Any = field(default=None, repr=False, compare=False)  # a torch ProcessGroup (None: size 1)

    @staticmethod
    def store(size: int, timeout_s: float, port: int | None = None) -> Any:
        """The ranks' meeting point on 127.0.0.1: rank 0 starts it (``port`` None: a free one, read from
        ``.port``), the others connect to its port."""
        timeout = timedelta(seconds=timeout_s)
        master = port is None
        return dist.TCPStore("127.0.0.1", port or 0, size, master, timeout=timeout, wait_for_workers=False)

    @classmethod
    def over(cls, store: Any, rank: int, size: int, cuda: bool, timeout_s: float) -> TPGroup:
        """This rank's group (blocks until every rank joined): NCCL between GPUs, gloo on CPUs."""
        return cls(rank, size, process_group(store, rank, size, cuda, timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial ``x`` (in place)."""
        self.pg.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over ranks of ``x`` (in place)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch stubs: RedOpType vs ReduceOp
        self.pg.allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def kv_head(self, num_kv_heads: int) -> tuple[int, int]:
        """(first kv head, count) this rank holds: a slice when they divide, else one replicated head."""
        if num_kv_heads >= self.size:
            per = num_kv_heads // self.size
            return self.rank * per, per
        return self.rank * num_kv_heads // self.size, 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the embedding / LM head on this rank (the last shard padded)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per


def process_group(store: Any, rank: int, size: int, cuda: bool, timeout_s: float) -> Any:
    """A process group of ``size`` ranks meeting at ``store`` (blocks until all joined): NCCL between
    GPUs, gloo on CPUs; every collective fails after ``timeout_s`` instead of hanging."""
    if cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """tensor_parallel_size must split the heads, the KV heads (or be a multiple of them) and the MLPs."""
    checks = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    for name, value in checks.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name}={value}")
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's num_key_value_heads={kv} neither divides it nor is "
            "divided by it"
        )


def shard_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The sizes one rank holds: its query and KV heads, its slice of every MLP and of the vocabulary."""
    check_divisible(cfg, tp.size)
    return cfg.model_copy(
        update={
            "num_attention_heads": cfg.num_attention_heads // tp.size,
            "num_key_value_heads": tp.kv_head(cfg.num_key_value_heads)[1],
            "intermediate_size": cfg.intermediate_size // tp.size,
            "moe_intermediate_size": cfg.moe_intermediate_size // tp.size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size // tp.size,
            "vocab_size": tp.vocab_rows(cfg.vocab_size)[1],
        }
    )
