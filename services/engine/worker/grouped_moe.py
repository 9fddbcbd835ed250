"""grouped_moe: the CPU / torch MoE expert step: tokens sorted by expert, one pair of matmuls per expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = topk_ids[t, k].

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K] fp32;
    topk_ids [T, K]. The (token, k) pairs are sorted by expert once; each expert with tokens runs its
    two matmuls over its rows (index_select in, index_add_ out, fp32 accumulation): no per-token loop.
    """
    num_experts, k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        tokens = rows // k
        h = silu_and_mul(_linear(x.index_select(0, tokens), w13[expert]))
        h = _linear(h, w2[expert]).float() * weights.index_select(0, rows).unsqueeze(1)
        out.index_add_(0, tokens, h)
    return out.to(x.dtype)


def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T; one row as a matrix-vector product (bf16 GEMV streams ~1.4x faster on CPU)."""
    if rows.shape[0] == 1:
        return torch.mv(weight, rows[0]).unsqueeze(0)
    return F.linear(rows, weight)
