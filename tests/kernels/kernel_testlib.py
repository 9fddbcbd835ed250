"""Shared helpers for the kernel tests: strided paged KV caches, block tables, error checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# Relative (Frobenius) error allowed against the fp32 reference, per input dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
NUM_LAYERS, LAYER = 3, 1

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def device() -> str:
    """The device kernels run on: CUDA when present, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """No NaN/inf anywhere and relative error within the dtype's tolerance (times `scale`)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "non-finite values in the kernel output"
    err = (actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
    assert err <= TOLERANCE[dtype] * scale, f"relative error {err:.3g} > {TOLERANCE[dtype] * scale:.3g}"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and strides as t, filled with NaN."""
    return torch.full_like(t, float("nan"))


@dataclass
class PagedKV:
    """A multi-layer block-major cache, one layer's strided K/V views, and the dense K/V it holds."""

    cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def empty_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, dev: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN-filled [num_blocks, layers, 2, block_size, Hkv, D] cache and layer LAYER's K and V views."""
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    key_cache, value_cache = cache[:, LAYER, 0], cache[:, LAYER, 1]
    assert not key_cache.is_contiguous()
    return cache, key_cache, value_cache


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    dev: str,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random dense K/V per sequence written into shuffled blocks; everything else in the cache is NaN.

    Unused block-table entries point at a NaN block, so reading past seq_len poisons the output.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    cache, key_cache, value_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, dev)
    order = torch.randperm(num_blocks)
    nan_block = int(order[-1])
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), nan_block, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=dev)
        v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=dev)
        for i in range(blocks_per_seq[b]):
            blk = int(order[used])
            used += 1
            table[b, i] = blk
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            key_cache[blk, : rows.stop - rows.start] = k[rows]
            value_cache[blk, : rows.stop - rows.start] = v[rows]
        keys.append(k)
        values.append(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return PagedKV(cache, key_cache, value_cache, table.to(dev), lens, keys, values)
