"""The CPU / torch MoE expert step (grouped_moe) equals the kernels' reference, and a per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvkernels.reference import ref_fused_moe
from services.engine.worker.grouped_moe import grouped_moe


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def _per_token(x, w13, w2, weights, ids) -> torch.Tensor:
    """The definition, one (token, k) at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = _silu_and_mul(w13[e].double() @ x[t].double())
            out[t] += float(weights[t, k]) * (w2[e].double() @ h)
    return out


def _routing(kind: str, tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if kind == "one-expert-takes-all":  # expert 3 is every token's first choice; 5 its second
        return torch.tensor([[3, 5]] * tokens)
    if kind == "idle-experts":  # only experts 0 and 1 get tokens, 2..7 get none
        return torch.tensor([[t % 2, 1 - t % 2] for t in range(tokens)])
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "one-expert-takes-all", "idle-experts"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_moe_equals_reference_and_definition(kind: str, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    e, h, i, k = 8, 32, 24, 2
    x = torch.randn(tokens, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    ids = _routing(kind, tokens, e, k, gen)
    weights = torch.rand(tokens, k, generator=gen)
    weights[0] = 0.5  # a tie between a token's two experts
    ours = grouped_moe(x, w13, w2, weights, ids, _silu_and_mul)
    torch.testing.assert_close(ours, ref_fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.double(), _per_token(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_kernels", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_moe_int8_experts_equal_the_dequantized_reference(
    tokens: int, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 experts (a scale per expert and output row) through kvferry's int8 GEMV / GEMM (few and
    many rows per expert), and through torch alone when the C++ kernels are missing."""
    import services.engine.worker.grouped_moe as gm
    from services.engine.worker.quantization.quantized_linear import quantize_rows_int8

    if not with_kernels:
        monkeypatch.setattr(gm, "cpu_ops", lambda: None)
    gen = torch.Generator().manual_seed(tokens)
    e, h, i, k = 8, 32, 24, 2
    x = torch.randn(tokens, h, generator=gen)
    (q13, s13), (q2, s2) = (
        quantize_rows_int8(torch.randn(e, 2 * i, h, generator=gen) * 0.2),
        quantize_rows_int8(torch.randn(e, h, i, generator=gen) * 0.2),
    )
    ids = _routing("random", tokens, e, k, gen)
    weights = torch.rand(tokens, k, generator=gen)
    ours = grouped_moe(x, q13, q2, weights, ids, _silu_and_mul, s13, s2)
    ref = ref_fused_moe(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
