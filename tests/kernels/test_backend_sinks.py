"""Attention sinks through ComputeBackend.attention of every backend (torch, the C++ CPU kernels, Triton):
the step's K/V written into a block-major cache, then decode rows and prefill chunks over their paged
context equal the reference, with random per-head sinks, GQA, and with and without a sliding window."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_testlib import assert_close

from kvkernels.reference import ref_paged_prefill_attention
from services.engine.worker.attention import ComputeBackend

HQ, HKV, D, BS, LAYERS, LAYER = 6, 2, 16, 8, 2, 1


def _backend(name: str) -> ComputeBackend:
    if name == "torch":
        from services.engine.worker.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "cpu":
        import kvkernels.cpu as ops

        if not ops.available():
            pytest.skip(f"kvkernels.cpu unavailable: {ops.unavailable_reason()}")
        from services.engine.worker.attention.cpu_backend import CpuBackend

        return CpuBackend(ops)
    from services.engine.worker.attention.triton_backend import TritonBackend

    return TritonBackend()


def check_backend(name: str, batch: list[tuple[int, int]], window: int, sinks: torch.Tensor | None) -> None:
    """batch: (q_len, seq_len) per sequence; positions before seq_len - q_len are already cached."""
    dev = "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"
    rng = random.Random(len(batch) * 31 + window)
    per_seq = [-(-n // BS) for _, n in batch]
    order = list(range(sum(per_seq) + 1))
    rng.shuffle(order)
    cache = torch.randn(len(order), LAYERS, 2, BS, HKV, D, device=dev)  # context K/V: random
    tables = [[order.pop() for _ in range(n)] for n in per_seq]
    slots = [tables[b][p // BS] * BS + p % BS for b, (q, n) in enumerate(batch) for p in range(n - q, n)]
    backend = _backend(name)
    meta = backend.build_metadata(
        [q for q, _ in batch], [n for _, n in batch], tables, slots, BS, torch.device(dev)
    )
    t = len(slots)
    q, k, v = (
        torch.randn(t, HQ, D, device=dev),
        torch.randn(t, HKV, D, device=dev),
        torch.randn(t, HKV, D, device=dev),
    )
    out = backend.attention(q.clone(), k, v, cache, LAYER, meta, D**-0.5, window, sinks)
    key_cache, value_cache = cache[:, LAYER, 0], cache[:, LAYER, 1]
    assert torch.equal(key_cache.flatten(0, 1)[meta.slot_mapping], k)  # the step's K/V were written
    expected = ref_paged_prefill_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        D**-0.5,
        window,
        sinks,
    )
    assert_close(out, expected, torch.float32)


MIXED = [(1, 1), (1, 40), (23, 23), (11, 40), (1, 70)]
DECODE = [(1, 1), (1, 17), (1, 40), (1, 70)]  # all single-token queries: Triton's decode kernel


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_backend_attention_with_sinks(name: str, batch: list[tuple[int, int]], window: int) -> None:
    torch.manual_seed(3)
    sinks = torch.randn(HQ) * 2
    check_backend(
        name, batch, window, sinks.to("cuda" if name == "triton" and torch.cuda.is_available() else "cpu")
    )


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_backend_attention_without_sinks(name: str) -> None:
    """sinks=None is the plain softmax (the default every other model uses)."""
    torch.manual_seed(4)
    check_backend(name, MIXED, 0, None)
