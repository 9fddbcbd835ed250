"""Paged prefill attention kernel vs its reference: packed ragged queries, cached prefixes, q_len 1 rows."""

import pytest
import torch
from kernel_testlib import assert_close, device, make_paged_kv

from kvkernels.paged_prefill_attention import paged_prefill_attention
from kvkernels.reference import ref_paged_prefill_attention

# (seq_len, q_len): a 1-token prompt, a whole prompt, a chunk after a cached prefix, a decode row, ...
MIXED = [(1, 1), (23, 23), (40, 11), (9, 1), (50, 37)]


def check_prefill(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    dev: str,
) -> None:
    """Random packed queries over a NaN-padded paged cache; kernel output must match the reference."""
    kv = make_paged_kv([s for s, _ in seqs], block_size, num_kv_heads, head_dim, dtype, dev)
    q_lens = torch.tensor([0] + [q for _, q in seqs])
    query_start_loc = q_lens.cumsum(0).to(torch.int32).to(dev)
    query = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, dtype=dtype, device=dev)
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        query_start_loc,
        kv.seq_lens,
        head_dim**-0.5,
    )
    assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(dtype: torch.dtype, group: int) -> None:
    check_prefill(MIXED, 8, 2, group, 16, dtype, device())


@pytest.mark.parametrize("head_dim", [8, 24, 80])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    check_prefill([(30, 30), (20, 3)], block_size, 1, 3, head_dim, torch.float16, device())


def test_prefill_max_query_len_hint() -> None:
    """Passing max_query_len (no host sync) gives the same result."""
    kv = make_paged_kv([12, 5], 4, 1, 16, torch.float32, device())
    query = torch.randn(8, 2, 16, device=device())
    qsl = torch.tensor([0, 3, 8], dtype=torch.int32, device=device())
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.25)
    assert torch.equal(paged_prefill_attention(*args, max_query_len=5), paged_prefill_attention(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_gpu_full_shapes(dtype: torch.dtype, head_dim: int, group: int) -> None:
    seqs = [(1, 1), (2048, 2048), (3000, 512), (700, 1), (1500, 1499), (129, 128)]
    check_prefill(seqs, 16, 8, group, head_dim, dtype, "cuda")


@pytest.mark.parametrize("window", [1, 6, 16, 45])
def test_prefill_sliding_window(window: int) -> None:
    """Each query sees only its last `window` positions, including rows whose whole first key tile is
    outside the window; blocks before the first query's window are NaN and must not be read."""
    seqs = [(1, 1), (23, 23), (40, 11), (9, 1), (150, 137)]
    kv = make_paged_kv([s for s, _ in seqs], 4, 2, 16, torch.float32, device())
    q_lens = torch.tensor([0] + [q for _, q in seqs])
    qsl = q_lens.cumsum(0).to(torch.int32).to(device())
    query = torch.randn(int(q_lens.sum()), 4, 16, device=device())
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.25)
    expected = ref_paged_prefill_attention(*args, window=window)
    for b, (n, q) in enumerate(seqs):
        dead = kv.block_tables[b, : max(0, n - q - window + 1) // 4].long()
        kv.key_cache[dead] = float("nan")
        kv.value_cache[dead] = float("nan")
    assert_close(paged_prefill_attention(*args, window=window), expected, torch.float32)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_sinks(window: int, group: int) -> None:
    """gpt-oss sinks ([Hq] logits in each head's softmax denominator): packed prompts, a chunk over a
    cached prefix, a decode row, GQA, with and without a sliding window."""
    seqs = [(1, 1), (23, 23), (40, 11), (9, 1)]
    kv = make_paged_kv([s for s, _ in seqs], 4, 2, 16, torch.float32, device())
    q_lens = torch.tensor([0] + [q for _, q in seqs])
    qsl = q_lens.cumsum(0).to(torch.int32).to(device())
    query = torch.randn(int(q_lens.sum()), 2 * group, 16, device=device())
    sinks = torch.randn(2 * group, device=device()) * 2
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.25)
    expected = ref_paged_prefill_attention(*args, window=window, sinks=sinks)
    plain = ref_paged_prefill_attention(*args, window=window)
    assert (expected - plain).norm() > 1e-2 * plain.norm()  # the sinks change the result
    out = paged_prefill_attention(*args, window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
