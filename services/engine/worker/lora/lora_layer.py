"""LoRA wrappers of a model's linears and token embedding: every adapter slot of a step in one op pair."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.lora.ops import LoRAOps
from services.engine.worker.lora.peft_adapter import LoRALayerWeights
from services.engine.worker.lora.plan import LoRAPlan, segment_plan


class LoRAStep:
    """What every LoRA module of the model shares: the ops, each slot's scaling, and this step's plans.

    ``plan`` groups the step's token rows by adapter slot (set before the forward); ``logits_plan`` does
    the same for the hidden rows that go to ``lm_head`` (set around the engine's ``compute_logits``; the
    embedding and ``lm_head`` of other callers, e.g. EAGLE drafting, run without adapters).
    """

    def __init__(self, ops: LoRAOps, slots: int, device: torch.device) -> None:
        self.ops, self.device = ops, device
        self.scale = torch.zeros(slots, dtype=torch.float32, device=device)
        self.token_slots: list[int] = []
        self.plan: LoRAPlan | None = None
        self.logits_plan: LoRAPlan | None = None

    def set_tokens(self, token_slots: list[int]) -> None:
        """This step's slot per token row (-1: the base model)."""
        self.token_slots = token_slots
        self.plan = segment_plan(token_slots, self.device)

    def select_logit_rows(self, rows: list[int]) -> None:
        """The token rows (indices into this step's tokens) whose hidden states ``lm_head`` gets next."""
        self.logits_plan = segment_plan([self.token_slots[r] for r in rows], self.device)


def _check_rank(rank: int, capacity: int) -> None:
    if rank > capacity:
        raise ValueError(f"LoRA rank {rank} exceeds this layer's capacity {capacity}")


class LoRALinear(nn.Module):
    """``y = base(x)``, plus for each row under adapter slot s and each shard j of the fused output:
    ``y[:, shard j] += (x A_sj^T) B_sj^T * scaling_s`` (all slots at once through ``step.ops``).

    ``a`` [slots, shards * max_rank, K] stacks each shard's A; ``b`` [slots, max_rank, N] holds each shard's
    B^T in that shard's output columns. ``lazy``: allocate them when an adapter first uses the module.
    """

    def __init__(
        self,
        base: nn.Module,
        shard_sizes: list[int],
        max_rank: int,
        dtype: torch.dtype,
        step: LoRAStep,
        logits: bool = False,
        lazy: bool = False,
    ) -> None:
        super().__init__()
        self.base, self.step, self.logits = base, step, logits
        self.in_features: int = getattr(base, "in_features")  # noqa: B009 - every linear class has them
        self.out_features: int = getattr(base, "out_features")  # noqa: B009
        self.shard_cols = [sum(shard_sizes[:j]) for j in range(len(shard_sizes) + 1)]
        self.max_rank, self.dtype = max_rank, dtype
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        if not lazy:
            self._allocate()

    def _allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.a is None or self.b is None:
            slots, shards, dev = self.step.scale.shape[0], len(self.shard_cols) - 1, self.step.device
            self.a = torch.zeros(
                slots, shards * self.max_rank, self.in_features, dtype=self.dtype, device=dev
            )
            self.b = torch.zeros(slots, self.max_rank, self.out_features, dtype=self.dtype, device=dev)
        return self.a, self.b

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Put an adapter's weights for this module in ``slot`` (None: the adapter does not touch it)."""
        if weights is None and self.a is None:
            return
        a, b = self._allocate()
        a[slot].zero_()
        b[slot].zero_()
        if weights is None:
            return
        r = weights.b.shape[0]
        _check_rank(r, self.max_rank)
        for j in range(len(self.shard_cols) - 1):
            a[slot, j * self.max_rank : j * self.max_rank + r] = weights.a[j * r : (j + 1) * r]
        b[slot, :r] = weights.b.to(b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = self.step.logits_plan if self.logits else self.step.plan
        if plan is None or self.a is None or self.b is None:
            return y
        if plan.num_rows != x.shape[0]:
            raise RuntimeError(f"LoRA: {x.shape[0]} rows reach a layer planned for {plan.num_rows}")
        s = self.step.ops.shrink(x, self.a, plan, self.step.scale)
        self.step.ops.expand(y, s, self.b, plan, self.shard_cols)
        return y

    def weight_bytes(self) -> int:
        """The adapter slots' bytes (``base`` is a submodule: model_loader.weight_bytes counts it itself)."""
        return sum(t.numel() * t.element_size() for t in (self.a, self.b) if t is not None)


class LoRAEmbedding(nn.Module):
    """``y = embed(ids)``, plus for each row under slot s: ``y += A_s^T[id] B_s^T * scaling_s`` (PEFT's
    embedding LoRA: A [r, vocab] is indexed by token id). Allocated when an adapter first uses it."""

    def __init__(
        self, base: nn.Module, vocab: int, hidden: int, max_rank: int, dtype: torch.dtype, step: LoRAStep
    ) -> None:
        super().__init__()
        self.base, self.step, self.max_rank, self.dtype = base, step, max_rank, dtype
        self.vocab, self.hidden = vocab, hidden
        self.a: torch.Tensor | None = None  # [slots, vocab, max_rank]: A^T, a row per token id
        self.b: torch.Tensor | None = None  # [slots, max_rank, hidden]: B^T

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Put an adapter's embedding LoRA in ``slot`` (None: the adapter does not touch the embedding)."""
        if weights is None and self.a is None:
            return
        if self.a is None or self.b is None:
            slots, dev = self.step.scale.shape[0], self.step.device
            self.a = torch.zeros(slots, self.vocab, self.max_rank, dtype=self.dtype, device=dev)
            self.b = torch.zeros(slots, self.max_rank, self.hidden, dtype=self.dtype, device=dev)
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            return
        r = weights.b.shape[0]
        _check_rank(r, self.max_rank)
        self.a[slot, :, :r] = weights.a.t().to(self.dtype)
        self.b[slot, :r] = weights.b.to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        plan = self.step.plan
        if plan is None or self.a is None or self.b is None or plan.num_rows != ids.shape[0]:
            return y  # (a row count other than the step's: a drafter embedding its tokens)
        s = (
            self.a[plan.row_slot, ids.index_select(0, plan.rows)].float()
            * self.step.scale[plan.row_slot, None]
        )
        self.step.ops.expand(y, s, self.b, plan, [0, y.shape[1]])
        return y

    def weight_bytes(self) -> int:
        """The adapter slots' bytes."""
        return sum(t.numel() * t.element_size() for t in (self.a, self.b) if t is not None)
