"""ParallelGroups: one rank's place in a tensor x pipeline grid of ranks, and the groups it talks in.

Global rank r is pipeline stage r // tp_size and tensor-parallel rank r % tp_size. The ranks of one
stage form a tensor-parallel group; the ranks with the same tensor-parallel rank form a pipeline group
(stage s sends to stage s + 1 there, and the last stage broadcasts the logits). Each group meets under
its own prefix of the engine's TCP store, so the groups never see each other's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.parallel.pp_stage import PPStage
from services.engine.worker.parallel.tp_group import TPGroup, process_group, shard_config


@dataclass(frozen=True)
class ParallelGroups:
    """Rank ``rank`` of ``tp_size * pp_size``: its tensor-parallel group and pipeline stage (None: size 1)."""

    rank: int
    tp: TPGroup | None
    pp: PPStage | None

    @classmethod
    def join(
        cls,
        store: Any,
        rank: int,
        tp_size: int,
        pp_size: int,
        num_layers: int,
        cuda: bool,
        timeout_s: float,
    ) -> ParallelGroups:
        """Join this rank's groups (blocks until every member joined)."""
        stage, tp_rank = divmod(rank, tp_size)
        tp = None
        if tp_size > 1:
            tp_store = dist.PrefixStore(f"tp{stage}/", store)
            tp = TPGroup.over(tp_store, tp_rank, tp_size, cuda, timeout_s)
        pp = None
        if pp_size > 1:
            pp_store = dist.PrefixStore(f"pp{tp_rank}/", store)
            pp = PPStage.of(
                stage, pp_size, num_layers, process_group(pp_store, stage, pp_size, cuda, timeout_s)
            )
        return cls(rank, tp, pp)


def rank_kv_config(cfg: ModelConfig, groups: ParallelGroups | None) -> ModelConfig:
    """The model config as this rank's KV cache sees it: its KV heads (tensor parallelism) and its
    stage's layers (pipeline parallelism)."""
    if groups is None:
        return cfg
    if groups.tp is not None:
        cfg = shard_config(cfg, groups.tp)
    if groups.pp is not None:
        cfg = cfg.model_copy(update={"num_hidden_layers": groups.pp.end - groups.pp.start})
    return cfg
