"""reshape_and_cache kernel vs its reference on strided per-layer views of a block-major cache."""

import pytest
import torch
from kernel_testlib import LAYER, device, empty_cache

from kvkernels.reference import ref_reshape_and_cache
from kvkernels.reshape_and_cache import reshape_and_cache


def check_cache_write(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    dev: str,
) -> None:
    """Scatter K/V (non-contiguous views of a fused qkv) into shuffled slots with padding; compare caches."""
    cache, key_cache, value_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, dev)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=dev)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, device=dev)[:num_tokens]
    slots[torch.rand(num_tokens, device=dev) < 0.2] = -1  # padding tokens
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(cache.isnan(), expected.isnan()), "wrong set of slots written"
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    assert (slots >= 0).any() and (~cache[:, LAYER].isnan()).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 24])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype, head_dim: int) -> None:
    check_cache_write(37, 7, 8, 2, head_dim, dtype, device())


def test_reshape_and_cache_all_padding_and_empty() -> None:
    cache, key_cache, value_cache = empty_cache(2, 4, 1, 8, torch.float32, device())
    kv = torch.randn(3, 1, 8, device=device())
    reshape_and_cache(
        kv, kv, key_cache, value_cache, torch.full((3,), -1, dtype=torch.int64, device=device())
    )
    reshape_and_cache(
        kv[:0], kv[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64, device=device())
    )
    assert cache.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_reshape_and_cache_gpu_full_shapes(dtype: torch.dtype, head_dim: int) -> None:
    check_cache_write(4096, 512, 16, 8, head_dim, dtype, "cuda")
