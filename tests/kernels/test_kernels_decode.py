"""Paged decode attention kernel vs its reference: ragged contexts, shuffled blocks, GQA, split-K."""

import pytest
import torch
from kernel_testlib import assert_close, device, make_paged_kv

from kvkernels.paged_decode_attention import choose_num_splits, paged_decode_attention
from kvkernels.reference import ref_paged_decode_attention


def check_decode(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | None,
    dev: str,
) -> None:
    """Random query over a NaN-padded paged cache; kernel output must match the reference."""
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, dev)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype, device=dev)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, num_splits)
    assert_close(out, ref_paged_decode_attention(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_reference(dtype: torch.dtype, group: int, num_splits: int | None) -> None:
    check_decode([1, 17, 40, 64], 16, 2, group, 16, dtype, num_splits, device())


@pytest.mark.parametrize("head_dim", [8, 24, 80])
@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    check_decode([5, 33, 70], block_size, 1, 4, head_dim, torch.float16, 2, device())


def test_decode_more_splits_than_key_tiles() -> None:
    """Empty splits (start past seq_len) must not disturb the reduce."""
    check_decode([1, 3, 130], 4, 2, 2, 16, torch.float32, 8, device())


def test_decode_zero_length_row_is_zero() -> None:
    """A padded batch row (seq_len 0) yields zeros, not NaN."""
    kv = make_paged_kv([9, 1], 4, 1, 16, torch.float32, device())
    kv.seq_lens[1] = 0
    query = torch.randn(2, 2, 16, device=device())
    for splits in (1, 2):
        out = paged_decode_attention(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25, splits
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out).all()


def test_choose_num_splits() -> None:
    assert choose_num_splits(batch=256, num_kv_heads=8, max_seq_len=512, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 33
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_gpu_full_shapes(
    dtype: torch.dtype, head_dim: int, group: int, num_splits: int | None
) -> None:
    lens = torch.randint(1, 4096, (16,)).tolist() + [1, 16, 17, 4096]
    check_decode(lens, 16, 8, group, head_dim, dtype, num_splits, "cuda")


@pytest.mark.parametrize("window", [1, 5, 16, 50])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_sliding_window(window: int, num_splits: int | None) -> None:
    """Each row attends only to its last `window` positions; blocks wholly before it are NaN (a freed
    block holds anything) and must not be read."""
    seq_lens = [1, 17, 40, 64, 130]
    kv = make_paged_kv(seq_lens, 8, 2, 16, torch.float32, device())
    query = torch.randn(len(seq_lens), 8, 16, device=device())
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    expected = ref_paged_decode_attention(*args, window=window)
    for b, n in enumerate(seq_lens):
        dead = kv.block_tables[b, : max(0, n - window) // 8].long()
        kv.key_cache[dead] = float("nan")
        kv.value_cache[dead] = float("nan")
    assert_close(paged_decode_attention(*args, num_splits, window=window), expected, torch.float32)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention_sinks(window: int, num_splits: int, group: int) -> None:
    """gpt-oss sinks ([Hq] logits in each head's softmax denominator) with GQA, split-K (the sink joins
    one split's partial only), a sliding window, a one-token row and NaN blocks before the window."""
    seq_lens = [1, 17, 40, 130]
    kv = make_paged_kv(seq_lens, 8, 2, 16, torch.float32, device())
    query = torch.randn(len(seq_lens), 2 * group, 16, device=device())
    sinks = torch.randn(2 * group, device=device()) * 2
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    expected = ref_paged_decode_attention(*args, window=window, sinks=sinks)
    plain = ref_paged_decode_attention(*args, window=window)
    assert (expected - plain).norm() > 1e-2 * plain.norm()  # the sinks change the result
    for b, n in enumerate(seq_lens):
        dead = kv.block_tables[b, : max(0, n - window) // 8 if window else 0].long()
        kv.key_cache[dead] = float("nan")
        kv.value_cache[dead] = float("nan")
    out = paged_decode_attention(*args, num_splits, window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
