"""PPStage: this rank's pipeline stage (a contiguous run of decoder layers) and the sends between stages.

Stage 0 embeds the tokens and runs the first layers; each stage hands its hidden states and residual to
the next; the last stage applies the final norm and the LM head and broadcasts the logits to every
stage, so every rank samples the same tokens from the same logits (as under tensor parallelism) and
keeps the same request state without tokens being sent back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_split(num_layers: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: as even as possible, the earlier stages one more
    (stage 0 also embeds, the last also runs the LM head; neither dominates on small models)."""
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={size} exceeds the model's num_hidden_layers={num_layers}: "
            "every stage needs a layer"
        )
    per, extra = divmod(num_layers, size)
    bounds, start = [], 0
    for stage in range(size):
        end = start + per + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class PPStage:
    """Stage ``stage`` of ``size``, holding decoder layers [start, end) of ``num_layers``."""

    stage: int
    size: int
    start: int
    end: int
    num_layers: int
    pg: Any = field(default=None, repr=False, compare=False)  # gloo / NCCL group over the stages

    @classmethod
    def of(cls, stage: int, size: int, num_layers: int, pg: Any = None) -> PPStage:
        start, end = layer_split(num_layers, size)[stage]
        return cls(stage, size, start, end, num_layers, pg)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def reads(self, name: str) -> bool:
        """Whether this stage reads checkpoint tensor ``name``: not another stage's decoder layers (the
        loader skips the embedding, norm and LM head where they have no place)."""
        match = _LAYER.search(name)
        return match is None or self.owns_layer(int(match.group(1)))

    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand this stage's output (hidden states and the residual stream) to the next stage."""
        self.pg.send([torch.stack([hidden, residual]).contiguous()], self.stage + 1, 0).wait()

    def recv_hidden(
        self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual, each [tokens, hidden]."""
        buf = torch.empty((2, tokens, hidden), dtype=dtype, device=device)
        self.pg.recv([buf], self.stage - 1, 0).wait()
        return buf[0], buf[1]

    def share_logits(
        self, logits: torch.Tensor | None, rows: int, vocab: int, device: torch.device
    ) -> torch.Tensor:
        """The last stage's fp32 logits on every stage (``logits``: the last stage's own, else None)."""
        if rows == 0:  # every stage skips together: the steps are the same on all of them
            return torch.empty((0, vocab), dtype=torch.float32, device=device)
        if logits is None:
            logits = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        else:
            logits = logits.contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = self.size - 1
        self.pg.broadcast([logits], opts).wait()
        return logits


def stage_layers(num_layers: int, pp: PPStage | None) -> range:
    """The decoder layers this rank runs (all of them without pipeline parallelism)."""
    return range(num_layers) if pp is None else range(pp.start, pp.end)
