"""FP8 E4M3 checkpoints (vLLM ``fp8``, compressed-tensors float 8-bit): weights and their scales as GroupQuantWeight."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight

log = logging.getLogger(__name__)
_SCALES = ("weight_scale", "weight_scale_inv")  # the multiplier per tensor, row or block (both names)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> GroupQuantWeight:
    """An E4M3 [N, K] weight with a scale per tensor (scalar), per row ([N] or [N, 1]) or per block."""
    n, k = weight.shape
    codes = weight.view(torch.uint8)
    s = scale.float()
    if s.numel() == 1:
        rows = s.reshape(1, 1).expand(n, 1)
        return GroupQuantWeight(codes, rows.contiguous(), torch.zeros(n, 1), 8, k, fmt="e4m3")
    if s.numel() == n:
        return GroupQuantWeight(codes, s.reshape(n, 1), torch.zeros(n, 1), 8, k, fmt="e4m3")
    if s.dim() == 2:  # [ceil(N / b), ceil(K / b)] blocks of b x b
        block = -(-n // s.shape[0])
        if -(-k // block) != s.shape[1] or k % block:
            raise ValueError(f"FP8 scale {tuple(s.shape)} does not tile a {n} x {k} weight in square blocks")
        rows = s.repeat_interleave(block, dim=0)[:n]
        return GroupQuantWeight(codes, rows.contiguous(), torch.zeros_like(rows), 8, block, fmt="e4m3")
    raise ValueError(f"FP8 scale of shape {tuple(s.shape)} for a {n} x {k} weight is not supported")


def iter_fp8(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
    """Float tensors as they come; each E4M3 weight, with its scale, as GroupQuantWeight at the end."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    dropped = 0
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part == "weight" and tensor.dtype == torch.float8_e4m3fn:
            weights[prefix] = tensor
        elif part in _SCALES:
            scales[prefix] = tensor
        elif part == "input_scale":
            dropped += 1  # static activation scales: kvferry computes activations in --dtype
        else:
            yield name, tensor
    if dropped:
        log.info(
            "FP8 checkpoint: %d input_scale tensors unused (weights-only FP8, activations in --dtype)",
            dropped,
        )
    for prefix, weight in weights.items():
        if prefix not in scales:
            raise ValueError(f"FP8 checkpoint: {prefix}.weight has no weight_scale")
        yield f"{prefix}.weight", fp8_weight(weight, scales[prefix])
