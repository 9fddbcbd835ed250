"""The Triton multi-LoRA shrink / expand kernels vs their twins in kvkernels/reference.py."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import assert_close, device

from kvkernels.lora import lora_expand, lora_shrink
from kvkernels.reference import ref_lora_expand, ref_lora_shrink


def plan(token_slots: list[int], dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """rows grouped by slot (base rows, -1, left out), seg_start, seg_slot, the longest segment."""
    order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
    slots = sorted({s for s, _ in order})
    counts = [sum(1 for s, _ in order if s == slot) for slot in slots]
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=dev)

    return tensor([t for _, t in order]), tensor(starts), tensor(slots), max(counts)


def check_pair(token_slots: list[int], k: int, shard_sizes: list[int], rank: int, dtype: torch.dtype) -> None:
    dev, slots = device(), 4
    shards, n = len(shard_sizes), sum(shard_sizes)
    cols = [sum(shard_sizes[:j]) for j in range(shards + 1)]
    x = torch.randn(len(token_slots), k, device=dev).to(dtype)
    a = (torch.randn(slots, shards * rank, k, device=dev) / k**0.5).to(dtype)
    b = torch.randn(slots, rank, n, device=dev).to(dtype)
    scale = torch.rand(slots, device=dev) + 0.5
    y = torch.randn(len(token_slots), n, device=dev).to(dtype)
    rows, seg_start, seg_slot, longest = plan(token_slots, dev)
    s = lora_shrink(x, a, rows, seg_start, seg_slot, scale, longest)
    s_ref = ref_lora_shrink(x, a, rows, seg_start, seg_slot, scale)
    assert_close(s, s_ref, dtype)
    out = y.clone()
    lora_expand(out, s_ref, b, rows, seg_start, seg_slot, cols, longest)
    expected = ref_lora_expand(y, s_ref, b, rows, seg_start, seg_slot, cols)
    assert_close(out - y, expected - y, dtype, scale=2.0)  # the added delta, relative to its own size
    base = torch.tensor([t for t, slot in enumerate(token_slots) if slot < 0], dtype=torch.long, device=dev)
    assert torch.equal(out[base], y[base])  # base-model rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_segments_and_three_shards_interpreted(dtype: torch.dtype) -> None:
    """Three adapters and base rows interleaved; q/k/v-like shards of unequal widths; K, N and r all
    partial tiles (rank 3 pads to 16; 70 > 64 columns takes two N tiles)."""
    check_pair([2, -1, 0, 2, 3, -1, 0, 2, 2], k=40, shard_sizes=[70, 12, 12], rank=3, dtype=dtype)


def test_one_long_segment_takes_several_row_blocks_interpreted() -> None:
    """A prefill-sized run of one adapter (70 rows: two blocks of 64, the second partial) beside a
    2-row one (whose second block exits at once); one shard; K a multiple of the K tile."""
    check_pair([1] * 70 + [3] * 2, k=64, shard_sizes=[24], rank=8, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_smollm2_shapes_on_the_gpu(dtype: torch.dtype) -> None:
    """SmolLM2's qkv (576 -> 576 + 192 + 192) and gate_up (576 -> 2 x 1536), rank 16: 4 adapters over 64
    decode rows, and a 300-row prefill of one adapter beside base rows."""
    for token_slots in ([t % 4 for t in range(64)], [2] * 300 + [-1] * 20):
        check_pair(token_slots, k=576, shard_sizes=[576, 192, 192], rank=16, dtype=dtype)
        check_pair(token_slots, k=576, shard_sizes=[1536, 1536], rank=16, dtype=dtype)


def test_the_twins_equal_per_token_peft_math() -> None:
    """The twins vs PEFT's formula token by token: y + (x A_j^T) B_j^T * scaling into shard j's columns."""
    torch.manual_seed(0)
    token_slots, sizes, rank, k = [1, -1, 0, 1, 1], [6, 3], 2, 5
    x, y = torch.randn(5, k, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    lora_a = torch.randn(2, 2, rank, k, dtype=torch.float64)  # [slot, shard, r, K]
    lora_b = [[torch.randn(n, rank, dtype=torch.float64) for n in sizes] for _ in range(2)]  # [slot][shard]
    scale = torch.tensor([0.5, 2.0], dtype=torch.float64)
    a = lora_a.reshape(2, 2 * rank, k)
    b = torch.stack([torch.cat([bj.t() for bj in lb], dim=1) for lb in lora_b])  # [slot, r, N]
    rows, seg_start, seg_slot, _ = plan(token_slots, "cpu")
    s = ref_lora_shrink(x, a, rows, seg_start, seg_slot, scale)
    out = ref_lora_expand(y, s.double(), b, rows, seg_start, seg_slot, [0, 6, 9])
    expected = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            delta = [(x[t] @ lora_a[slot, j].t()) @ lora_b[slot][j].t() * scale[slot] for j in range(2)]
            expected[t] += torch.cat(delta)
    torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-5, rtol=1e-5)
