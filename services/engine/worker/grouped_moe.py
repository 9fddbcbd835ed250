"""grouped_moe: the CPU / torch MoE expert step: tokens sorted by expert, one pair of matmuls per expert."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from services.engine.worker.quantization.quantized_linear import cpu_ops, int8_matmul


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = topk_ids[t, k].

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K] fp32;
    topk_ids [T, K]. The (token, k) pairs are sorted by expert once; each expert with tokens runs its
    two matmuls over its rows (index_select in, index_add_ out, fp32 accumulation): no per-token loop.
    With scales (``[E, 2I]`` / ``[E, H]`` in x's dtype) the weights are int8 codes, one scale per
    (expert, output row), multiplied by kvferry's int8 kernels without a dequantized copy.
    """
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert, tokens, rows in by_expert(topk_ids, w13.shape[0]):
        up = _linear(x.index_select(0, tokens), w13[expert], None if w13_scale is None else w13_scale[expert])
        h = silu_and_mul(up)
        down = _linear(h, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_add_(0, tokens, down.float() * weights.index_select(0, rows).unsqueeze(1))
    return out.to(x.dtype)


def by_expert(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its tokens, its (token, k) pair indices into ``topk_ids.reshape(-1)``) for every expert that
    has tokens: the pairs are sorted by expert once (stable), no per-token loop."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    start = 0
    for expert, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            rows = order[start : start + n]
            yield expert, rows // k, rows
        start += n


def _linear(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight.T (weight int8 codes when there is a scale); one float row as a matrix-vector
    product (bf16 GEMV streams ~1.4x faster on CPU)."""
    if scale is not None:
        return int8_matmul(rows, weight, scale, cpu_ops())
    if rows.shape[0] == 1:
        return torch.mv(weight, rows[0]).unsqueeze(0)
    return F.linear(rows, weight)
