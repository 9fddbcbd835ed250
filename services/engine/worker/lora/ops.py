"""The batched LoRA op pair (shrink: x A^T per row by its adapter slot; expand: add s B into y) per device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvkernels.reference import ref_lora_expand, ref_lora_shrink
from services.engine.worker.lora.plan import LoRAPlan

Shrink = Callable[..., torch.Tensor]
Expand = Callable[..., None]


@dataclass(frozen=True)
class LoRAOps:
    """``shrink(x, a, plan, scale) -> s [P, R] fp32``; ``expand(y, s, b, plan, shard_cols)`` adds in place.

    ``a`` [S, R, K] and ``b`` [S, r, N] hold every slot's weights (R = shards * r); ``scale`` fp32 [S];
    shard j's output columns ``shard_cols[j]:shard_cols[j + 1]`` take ``s[:, j * r:(j + 1) * r] @ b[slot]``.
    """

    name: str
    shrink: Shrink
    expand: Expand


def _torch_shrink(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan, scale: torch.Tensor) -> torch.Tensor:
    return ref_lora_shrink(x, a, plan.rows, plan.seg_start_host, plan.seg_slot_host, scale)


def _torch_expand(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, plan: LoRAPlan, shard_cols: list[int]
) -> None:
    y.copy_(ref_lora_expand(y, s, b, plan.rows, plan.seg_start_host, plan.seg_slot_host, shard_cols))


def _cpu_ops() -> LoRAOps | None:
    from kvkernels import cpu

    ext = cpu.load()
    if ext is None or not hasattr(ext, "lora_shrink"):
        return None

    def shrink(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan, scale: torch.Tensor) -> torch.Tensor:
        s = torch.empty(plan.rows.shape[0], a.shape[1], dtype=torch.float32)
        ext.lora_shrink(s, x, a, plan.rows, plan.seg_start, plan.seg_slot, scale)
        return s

    def expand(
        y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, plan: LoRAPlan, shard_cols: list[int]
    ) -> None:
        ext.lora_expand(y, s, b, plan.rows, plan.seg_start, plan.seg_slot, shard_cols)

    return LoRAOps("C++ segment kernels (kvkernels/cpu/csrc/lora.cpp)", shrink, expand)


def _triton_ops() -> LoRAOps:
    from kvkernels.lora import lora_expand, lora_shrink

    def shrink(x: torch.Tensor, a: torch.Tensor, plan: LoRAPlan, scale: torch.Tensor) -> torch.Tensor:
        return lora_shrink(x, a, plan.rows, plan.seg_start, plan.seg_slot, scale, plan.max_segment)

    def expand(
        y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, plan: LoRAPlan, shard_cols: list[int]
    ) -> None:
        lora_expand(y, s, b, plan.rows, plan.seg_start, plan.seg_slot, shard_cols, plan.max_segment)

    return LoRAOps("Triton segment kernels (kvkernels/lora.py)", shrink, expand)


TORCH_OPS = LoRAOps(
    "torch, one pair of matmuls per adapter (kvkernels/reference.py)", _torch_shrink, _torch_expand
)


def select_ops(device: torch.device, backend: str) -> LoRAOps:
    """Triton kernels where the engine runs its Triton backend, the C++ kernels on CPU, else plain torch."""
    if backend == "triton":
        return _triton_ops()
    if device.type == "cpu":
        return _cpu_ops() or TORCH_OPS
    return TORCH_OPS
