"""RMSNorm, rotary embedding and SiLU-and-mul kernels vs their references (strided inputs, all dtypes)."""

import pytest
import torch
from kernel_testlib import assert_close, device

from kvkernels.activation import silu_and_mul
from kvkernels.reference import build_cos_sin_cache, ref_rms_norm, ref_rotary_embedding, ref_silu_and_mul
from kvkernels.rms_norm import rms_norm
from kvkernels.rotary import rotary_embedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool, dev: str) -> None:
    """x is a column slice of a wider tensor (row stride != hidden)."""
    x = torch.randn(num_tokens, hidden + 5, dtype=dtype, device=dev)[:, :hidden]
    weight = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=dev) if with_residual else None
    out, expected = rms_norm(x, weight, 1e-6, residual), ref_rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert_close(out[1], expected[1], dtype, scale=0.5)
        out, expected = out[0], expected[0]
    assert_close(out, expected, dtype, scale=0.5)


def check_rotary(
    num_tokens: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    rot_dim: int,
    is_neox: bool,
    dtype: torch.dtype,
    dev: str,
) -> None:
    """q and k are views of a fused qkv tensor; positions are random; partial rotary when rot_dim < D."""
    num_heads = num_kv_heads * group
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=dev)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    cache = build_cos_sin_cache(rot_dim, 4096, 10000.0, None, dtype).to(dev)
    positions = torch.randint(0, 4096, (num_tokens,), device=dev)
    out = rotary_embedding(positions, query, key, cache, is_neox)
    expected = ref_rotary_embedding(positions, query, key, cache, is_neox)
    for got, want in zip(out, expected, strict=True):
        assert_close(got, want, dtype, scale=0.5)


def check_silu(num_tokens: int, inter: int, dtype: torch.dtype, dev: str) -> None:
    x = torch.randn(num_tokens, 2 * inter + 3, dtype=dtype, device=dev)[:, : 2 * inter]
    assert_close(silu_and_mul(x), ref_silu_and_mul(x), dtype, scale=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(19, 96, dtype, with_residual, device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(16, 16), (24, 8)])
def test_rotary_matches_reference(dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int) -> None:
    check_rotary(11, 2, 4, head_dim, rot_dim, is_neox, dtype, device())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    check_silu(13, 48, dtype, device())


def test_pointwise_empty_batch() -> None:
    x = torch.randn(0, 32, device=device())
    assert rms_norm(x, torch.ones(32, device=device()), 1e-6).shape == (0, 32)
    assert silu_and_mul(x).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_rms_norm_gpu_full_shapes(dtype: torch.dtype, hidden: int) -> None:
    check_rms_norm(1000, hidden, dtype, False, "cuda")
    check_rms_norm(1000, hidden, dtype, True, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (128, 128), (256, 64)])
def test_rotary_gpu_full_shapes(dtype: torch.dtype, head_dim: int, rot_dim: int) -> None:
    for is_neox in (True, False):
        check_rotary(2000, 8, 4, head_dim, rot_dim, is_neox, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_gpu_full_shapes(dtype: torch.dtype) -> None:
    check_silu(2000, 14336, dtype, "cuda")
