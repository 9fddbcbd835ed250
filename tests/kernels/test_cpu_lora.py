"""The C++ multi-LoRA shrink / expand (kvkernels/cpu/csrc/lora.cpp) vs their twins in kvkernels/reference.py."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_testlib import assert_close

import kvkernels.cpu as kc
from kvkernels.reference import ref_lora_expand, ref_lora_shrink
from services.engine.worker.lora.plan import segment_plan


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    """The compiled extension; every test here is skipped (with the reason) when it cannot be built."""
    module = kc.load()
    if module is None:
        pytest.skip(f"kvkernels.cpu unavailable: {kc.unavailable_reason()}")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("token_slots", "k", "shard_sizes", "rank"),
    [
        ([2, -1, 0, 2, 3, -1, 0, 2, 2, 2, 2, 1], 40, [70, 12, 12], 3),  # 5 rows of slot 2: two token blocks
        ([t % 16 for t in range(64)], 576, [576, 192, 192], 16),  # SmolLM2's qkv, 16 adapters, decode
        ([5] * 37 + [-1] * 3, 1536, [576], 16),  # down_proj: one adapter's prefill beside base rows
    ],
)
def test_shrink_and_expand_match_the_twins(
    ops: ModuleType, token_slots: list[int], k: int, shard_sizes: list[int], rank: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    plan = segment_plan(token_slots, torch.device("cpu"))
    assert plan is not None
    slots, n = 16, sum(shard_sizes)
    cols = [sum(shard_sizes[:j]) for j in range(len(shard_sizes) + 1)]
    x = torch.randn(len(token_slots), k + 3)[:, :k].to(dtype)  # rows strided: a view, as linears get
    a = (torch.randn(slots, len(shard_sizes) * rank, k) / k**0.5).to(dtype)
    b = torch.randn(slots, rank, n).to(dtype)
    scale = torch.rand(slots) + 0.5
    y = torch.randn(len(token_slots), n).to(dtype)
    s = torch.empty(plan.rows.shape[0], a.shape[1])
    ops.lora_shrink(s, x, a, plan.rows, plan.seg_start, plan.seg_slot, scale)
    s_ref = ref_lora_shrink(x, a, plan.rows, plan.seg_start, plan.seg_slot, scale)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=1e-4)  # fp32 sums in another order
    out = y.clone()
    ops.lora_expand(out, s_ref, b, plan.rows, plan.seg_start, plan.seg_slot, cols)
    expected = ref_lora_expand(y, s_ref, b, plan.rows, plan.seg_start, plan.seg_slot, cols)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    else:  # one rounding of the same fp32 sum: equal but where the sums' order flips a rounding
        assert (out != expected).float().mean() < 0.01
        assert_close(out, expected, dtype)
    base = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(out[base], y[base])


def test_bad_plans_are_errors_naming_the_problem(ops: ModuleType) -> None:
    x, a, scale = torch.randn(4, 8), torch.randn(2, 3, 8), torch.ones(2)
    rows, s = torch.arange(4), torch.empty(4, 3)
    with pytest.raises(RuntimeError, match="segments must cover rows exactly"):
        ops.lora_shrink(s, x, a, rows, torch.tensor([0, 3]), torch.tensor([1]), scale)
    with pytest.raises(RuntimeError, match="bad segment 0"):
        ops.lora_shrink(s, x, a, rows, torch.tensor([0, 4]), torch.tensor([2]), scale)
    with pytest.raises(RuntimeError, match="a must be a contiguous"):
        ops.lora_shrink(s, x, a.double(), rows, torch.tensor([0, 4]), torch.tensor([1]), scale)
    with pytest.raises(RuntimeError, match="shard_cols must span"):
        ops.lora_expand(
            torch.zeros(4, 6), s, torch.zeros(2, 3, 6), rows, torch.tensor([0, 4]), torch.tensor([1]), [0, 5]
        )
