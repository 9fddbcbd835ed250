"""LoRALinear: a base linear layer plus per-slot adapters, applied per run of tokens in a mixed batch."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.lora.peft_adapter import LoRALayerWeights

DENSE_MAX_TOKENS = 128  # up to this many tokens, a step with 3+ adapters runs all slots in one masked GEMM


class LoRAStep:
    """This step's tokens per adapter slot, set before the forward.

    ``groups``: ``(slot, rows)`` with rows a ``slice`` when the slot's tokens are one run, else an index
    tensor (gathered, then scattered back). ``token_slot`` / ``token_scale`` (-1 / 0 for base-model
    tokens) drive the dense form: every slot's shrink in one GEMM, a mask keeping each token's own.
    """

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.token_slot: torch.Tensor | None = None
        self.token_scale: torch.Tensor | None = None
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(
        self,
        groups: list[tuple[int, slice | torch.Tensor]],
        token_slot: torch.Tensor | None,
        token_scale: torch.Tensor | None,
    ) -> None:
        self.groups, self.token_slot, self.token_scale = groups, token_slot, token_scale
        self._masks = {}

    @property
    def dense(self) -> bool:
        return self.token_slot is not None

    def mask(self, rank: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * rank]: the token's scaling on its slot's columns, 0 elsewhere (cached per step)."""
        key = (rank, dtype)
        if key not in self._masks:
            assert self.token_slot is not None and self.token_scale is not None
            col_slot = torch.arange(slots * rank) // rank
            keep = self.token_slot[:, None] == col_slot[None, :]
            self._masks[key] = (keep * self.token_scale[:, None]).to(dtype)
        return self._masks[key]


class LoRALinear(nn.Module):
    """``y = base(x)``, then for each token under adapter slot s: ``y += (x A_s^T) B_s^T * scaling_s``.

    Per slot, the shrink (x A^T, rank r) and expand (B) are two small GEMMs over that slot's rows; with
    many adapters and few tokens (decode), every slot's A is applied at once and masked per token (one
    shrink GEMM over all slots, one expand), so the cost does not grow with the number of adapters.
    """

    def __init__(
        self, base: nn.Module, slots: int, max_rank: int, dtype: torch.dtype, step: LoRAStep
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = getattr(base, "in_features")  # noqa: B009 - every linear class has them
        self.out_features: int = getattr(base, "out_features")  # noqa: B009
        self.slots, self.max_rank = slots, max_rank
        self.a = torch.zeros(slots, max_rank, self.in_features, dtype=dtype)  # rows past a slot's rank stay 0
        self.b = torch.zeros(self.out_features, slots, max_rank, dtype=dtype)
        self.ranks = [0] * slots
        self.scaling = [0.0] * slots
        self.step = step

    def set_slot(self, slot: int, weights: LoRALayerWeights | None, scaling: float) -> None:
        """Put an adapter's weights for this layer in ``slot`` (None: the adapter does not touch it)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        self.ranks[slot], self.scaling[slot] = 0, 0.0
        if weights is None:
            return
        r = weights.a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"LoRA rank {r} exceeds this layer's capacity {self.max_rank}")
        self.a[slot, :r] = weights.a.to(self.a.dtype)
        self.b[:, slot, :r] = weights.b.to(self.b.dtype)
        self.ranks[slot], self.scaling[slot] = r, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.step.dense:
            a = self.a.view(self.slots * self.max_rank, self.in_features)
            b = self.b.view(self.out_features, self.slots * self.max_rank)
            shrunk = (x @ a.t()) * self.step.mask(self.max_rank, self.slots, x.dtype)
            return y + shrunk @ b.t()
        for slot, rows in self.step.groups:
            r = self.ranks[slot]
            if not r:
                continue
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            delta = ((xs @ self.a[slot, :r].t()) @ self.b[:, slot, :r].t()) * self.scaling[slot]
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y

    def weight_bytes(self) -> int:
        """The adapter slots' bytes (``base`` is a submodule: model_loader.weight_bytes counts it itself)."""
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
