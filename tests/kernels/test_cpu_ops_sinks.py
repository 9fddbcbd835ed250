"""kvkernels.cpu's attention sinks (gpt-oss) against kvkernels/reference.py: every planner path and decode
kernel, and the sink's algebra (-inf changes nothing, a finite sink shrinks every row)."""

from __future__ import annotations

import random

import pytest
import torch
from cpu_attention_testlib import check_attention, check_runs, mixed_batch, run_inputs

import kvkernels.cpu as kc

pytestmark = pytest.mark.usefixtures("ops")  # every test needs the compiled extension (conftest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sinks(dtype: torch.dtype, decode_kernel: str) -> None:
    """gpt-oss attention sinks ([Hq] logits in each head's softmax denominator) through every path the
    planner picks, with each decode kernel: mixed decode / prefill batches (GQA 1, 3, 4, head dims 64, 80,
    128), decode rows split into kv ranges (the sink joins the reduce once), sliding windows (NaN blocks
    before them), cascade runs over shared prefixes (their partials reduce with each row's own)."""
    rng = random.Random(7)
    for i, (hq, hkv, d, bs) in enumerate([(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 16), (12, 3, 80, 32)]):
        batch = mixed_batch(rng, 6, 150) + [(1, n) for n in (1, 17, 65, 700)]
        check_attention(batch, hq, hkv, d, bs, dtype, 100 + i, sinks=True)
        check_attention(batch, hq, hkv, d, bs, dtype, 110 + i, split_tokens=48, sinks=True)
        check_attention(batch, hq, hkv, d, bs, dtype, 120 + i, window=33, sinks=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        check_runs([(8, [1, 33, 0, 200]), (5, [16, 7])], 12, 2, 64, dtype, 131, torch.randn(12) * 2)
        check_runs([(4, [9, 90, 3])], 9, 3, 80, dtype, 132, torch.randn(9) * 2)
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_sinks_change_the_output_and_minus_inf_sinks_do_not() -> None:
    """A sink at -inf adds exp(-inf) = 0: bit-equal to no sinks; finite sinks shrink every output row."""
    torch.manual_seed(5)
    query, key_cache, value_cache, table, qsl, seq_lens = run_inputs(
        [(4, [9, 90, 3])], 8, 2, 64, torch.float32, 5
    )
    outs = []
    for sinks in (None, torch.full((8,), float("-inf")), torch.full((8,), 3.0)):
        outs.append(torch.empty_like(query))
        kc.paged_attention(outs[-1], query, key_cache, value_cache, table, qsl, seq_lens, 0.125, sinks=sinks)
    assert torch.equal(outs[0], outs[1])
    assert (outs[2].norm(dim=-1) < outs[0].norm(dim=-1)).all()
