"""The fused MoE kernel (token -> expert alignment, gate/up + SiLU, down + routing weight) vs its reference."""

import pytest
import torch
from kernel_testlib import assert_close, device

from kvkernels.fused_moe import CONFIGS, choose_config, fused_moe, moe_align_block_size
from kvkernels.reference import ref_fused_moe

# Elementwise tolerance per dtype: fp32 accumulation order only for fp32; for 16-bit outputs (one
# rounding at the end, the silu * up activation rounded like the reference's) one ulp of the output
# dtype, relative (bf16 2**-7, fp16 2**-10), plus a small absolute term for values near zero.
ATOL_RTOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-3, 2**-10), torch.bfloat16: (1e-3, 2**-7)}


def make_weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, dev: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] scaled so activations and outputs stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=dev) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def route(num_tokens: int, num_experts: int, topk: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing over random logits, renormalised: weights float32, ids int64."""
    weights, ids = torch.randn(num_tokens, num_experts, device=dev).softmax(-1).topk(topk, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = fused_moe(x, w13, w2, weights, ids)
    expected = ref_fused_moe(x, w13, w2, weights, ids)
    assert_close(out, expected, x.dtype)
    atol, rtol = ATOL_RTOL[x.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter"), [(32, 64), (64, 48)])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_matches_reference_interpreted(
    num_tokens: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    """(64, 48): K and N tiles both partial (48 % 64); (32, 64): the H loop partial, I tiles full."""
    dev = device()
    x = torch.randn(num_tokens, hidden, device=dev).to(dtype)
    w13, w2 = make_weights(8, hidden, inter, dtype, dev)
    check(x, w13, w2, *route(num_tokens, 8, 2, dev))


def test_fused_moe_wide_tiles_and_fp16_interpreted() -> None:
    """T * K / E rows per expert large enough for the 64- and 128-row configs; fp16 for once."""
    dev = device()
    for num_tokens, topk, dtype in ((130, 2, torch.float16), (50, 4, torch.float32)):
        x = torch.randn(num_tokens, 32, device=dev).to(dtype)
        w13, w2 = make_weights(4, 32, 32, dtype, dev)
        check(x, w13, w2, *route(num_tokens, 4, topk, dev))
    assert (choose_config(130, 2, 4).block_m, choose_config(50, 4, 4).block_m) == (128, 64)


def test_identical_weights_and_idle_experts_poisoned_interpreted() -> None:
    """Equal routing weights (ties); only experts 1 and 6 routed to: the NaN weights of the idle ones
    and every padded row are never read into the output."""
    dev, num_tokens = device(), 9
    x = torch.randn(num_tokens, 64, device=dev)
    w13, w2 = make_weights(8, 64, 32, torch.float32, dev)
    idle = torch.tensor([0, 2, 3, 4, 5, 7], device=dev)
    w13[idle], w2[idle] = float("nan"), float("nan")
    ids = torch.tensor([[1, 6], [6, 1]], device=dev).repeat(5, 1)[:num_tokens]
    weights = torch.full((num_tokens, 2), 0.5, device=dev)
    out = check(x, w13, w2, weights, ids)
    swapped = fused_moe(x, w13, w2, weights, ids.flip(-1))  # the slot order of equal weights is moot
    torch.testing.assert_close(swapped, out, atol=1e-6, rtol=1e-6)


def test_one_expert_takes_every_token_interpreted() -> None:
    dev, num_tokens = device(), 33
    x = torch.randn(num_tokens, 32, device=dev).to(torch.bfloat16)
    w13, w2 = make_weights(8, 32, 64, torch.bfloat16, dev)
    weights, ids = route(num_tokens, 8, 2, dev)
    ids[:, 0] = 5  # expert 5 in every token's top-2, the other slot anything but 5
    ids[:, 1] = torch.where(ids[:, 1] == 5, 3, ids[:, 1])
    check(x, w13, w2, weights, ids)
    ones = torch.ones(num_tokens, 1, device=dev)  # top-1, all to one expert: a plain MLP
    check(x, w13, w2, ones, torch.full((num_tokens, 1), 2, device=dev))


def test_single_token_top1_and_unnormalised_weights_interpreted() -> None:
    dev = device()
    x = torch.randn(1, 64, device=dev)
    w13, w2 = make_weights(8, 64, 64, torch.float32, dev)
    check(x, w13, w2, torch.tensor([[0.7]], device=dev), torch.tensor([[7]], device=dev))
    check(x, w13, w2, torch.tensor([[2.0, -0.25]], device=dev), torch.tensor([[0, 7]], device=dev))


def test_fused_moe_empty_batch_and_bad_shapes() -> None:
    x = torch.zeros(0, 32)
    w13, w2 = make_weights(4, 32, 16, torch.float32, "cpu")
    assert fused_moe(x, w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64)).shape == (0, 32)
    ids = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(torch.zeros(1, 32), w13, w2.transpose(1, 2), torch.zeros(1, 2), ids)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(("num_tokens", "num_experts", "topk"), [(1, 8, 2), (33, 8, 2), (50, 60, 4)])
def test_moe_align_block_size_invariants(num_tokens: int, num_experts: int, topk: int, block_m: int) -> None:
    _, ids = route(num_tokens, num_experts, topk, "cpu")
    ids[: num_tokens // 2, 0] = 3  # skewed: one expert crowded, many idle
    ids[: num_tokens // 2, 1:] = torch.where(ids[: num_tokens // 2, 1:] == 3, 0, ids[: num_tokens // 2, 1:])
    num_rows = num_tokens * topk
    sorted_ids, expert_ids, total = moe_align_block_size(ids, num_experts, block_m)
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    padded = -(-counts // block_m) * block_m
    assert int(total) == int(padded.sum()) and int(total) % block_m == 0
    real = sorted_ids[sorted_ids < num_rows]
    assert torch.equal(real.sort().values, torch.arange(num_rows, dtype=torch.int32))  # each (t, k) once
    assert (sorted_ids[int(total) :] == num_rows).all()  # past the total: sentinels only
    used = expert_ids[: int(total) // block_m]
    assert (used >= 0).all() and (expert_ids[int(total) // block_m :] == -1).all()
    assert torch.equal(torch.bincount(used.long(), minlength=num_experts) * block_m, padded)
    assert (used[1:] >= used[:-1]).all()  # experts in order, each group contiguous
    flat = ids.flatten()
    for block, expert in enumerate(used.tolist()):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_rows].long()
        assert (flat[rows] == expert).all()
    for expert in range(num_experts):  # within an expert: ascending rows, then the padding
        group = sorted_ids[: int(total)][used.repeat_interleave(block_m) == expert]
        n = int(counts[expert])
        assert torch.equal(group[:n].long(), (flat == expert).nonzero().squeeze(1))
        assert (group[n:] == num_rows).all()


def test_choose_config_grows_with_rows_per_expert() -> None:
    picked = [choose_config(t, 2, 8) for t in (1, 64, 65, 128, 256, 4096)]
    assert [c.block_m for c in picked] == [16, 16, 32, 32, 64, 128]
    assert {choose_config(t, 2, 4) for t in (2, 40, 100, 512)} == set(CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256])
@pytest.mark.parametrize(
    ("hidden", "inter", "num_experts", "topk"),
    [(4096, 14336, 8, 2), (2048, 1408, 60, 4)],  # Mixtral-8x7B, Qwen1.5-MoE-A2.7B
)
def test_fused_moe_full_shapes(num_tokens: int, hidden: int, inter: int, num_experts: int, topk: int) -> None:
    x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
    w13, w2 = make_weights(num_experts, hidden, inter, torch.bfloat16, "cuda")
    check(x, w13, w2, *route(num_tokens, num_experts, topk, "cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_fused_moe_int8_experts_match_reference_interpreted(num_tokens: int, dtype: torch.dtype) -> None:
    """int8 codes with a scale per (expert, output row), applied to each GEMM's sums: equal to the
    reference on the dequantized weights; partial K and N tiles (H 64, I 48)."""
    from services.engine.worker.quantization.quantized_linear import quantize_rows_int8

    dev = device()
    w13, w2 = make_weights(8, 64, 48, torch.float32, dev)
    (q13, s13), (q2, s2) = quantize_rows_int8(w13), quantize_rows_int8(w2)
    s13, s2 = s13.to(dtype), s2.to(dtype)
    x = torch.randn(num_tokens, 64, device=dev).to(dtype)
    weights, ids = route(num_tokens, 8, 2, dev)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2)
    expected = ref_fused_moe(x, q13, q2, weights, ids, s13, s2)
    atol, rtol = ATOL_RTOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="int8"):
        fused_moe(x, q13, q2, weights, ids)  # codes without their scales
