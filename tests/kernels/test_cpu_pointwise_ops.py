"""kvkernels.cpu (the C++ CPU extension) vs kvkernels/reference.py and torch: KV cache writes, RMSNorm, rotary,
SiLU-and-mul, weight-only int4/int8 linears, and the build's identity and cache."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_testlib import assert_close, empty_cache

import kvkernels.cpu as kc
from kvkernels.cpu import build
from kvkernels.reference import (
    build_cos_sin_cache,
    ref_reshape_and_cache,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from services.engine.worker.quantization.quantized_linear import pack_int4_tiles


@pytest.fixture(scope="module", autouse=True)
def ops() -> ModuleType:
    """The compiled extension; every test here is skipped (with the reason) when it cannot be built."""
    module = kc.load()
    if module is None:
        pytest.skip(f"kvkernels.cpu unavailable: {kc.unavailable_reason()}")
    return module


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_reshape_and_cache(src_dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int) -> None:
    """K/V are views of a fused qkv tensor; slots are shuffled, some -1; untouched slots stay NaN."""
    torch.manual_seed(block_size)
    t, hkv, d = 37, 2, 24
    qkv = torch.randn(t, 4 + 2 * hkv, d, dtype=src_dtype)
    key, value = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
    num_blocks = -(-t // block_size) + 3
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[::5] = -1
    cache, key_cache, value_cache = empty_cache(num_blocks, block_size, hkv, d, cache_dtype, "cpu")
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    kc.reshape_and_cache(key, value, key_cache, value_cache, slots.to(torch.int32))
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)


HIDDEN = [16, 24, 100, 576, 768, 4096]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_bit_identical(hidden: int, dtype: torch.dtype) -> None:
    """Same fp32 roundings in the same order as the reference: equal bits, fp32 and bf16 alike."""
    torch.manual_seed(hidden)
    x = (3 * torch.randn(9, hidden + 5)).to(dtype)[:, :hidden]  # rows strided
    for weight in ((1 + 0.1 * torch.randn(hidden)).to(dtype), 1 + 0.1 * torch.randn(hidden)):
        assert torch.equal(kc.rms_norm(x, weight, 1e-6), ref_rms_norm(x, weight, 1e-6))
    residual = torch.randn(9, hidden, dtype=dtype)
    normed, new_residual = kc.fused_add_rms_norm(x, residual, weight.to(dtype), 1e-5)
    want_normed, want_residual = ref_rms_norm(x, weight.to(dtype), 1e-5, residual)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(normed, want_normed)


def test_rms_norm_keeps_leading_dims() -> None:
    x = torch.randn(2, 3, 64)
    w = torch.randn(64)
    assert torch.equal(kc.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (128, 128), (80, 80), (64, 32), (24, 24)])
def test_rotary_embedding_in_place(head_dim: int, rot_dim: int, dtype: torch.dtype, is_neox: bool) -> None:
    """q and k are views of a fused qkv tensor; rotated in place, equal bits to the reference."""
    torch.manual_seed(head_dim + rot_dim)
    t, hq, hkv = 11, 6, 2
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, dtype=dtype)
    query, key = qkv[:, :hq], qkv[:, hq : hq + hkv]
    value_before = qkv[:, hq + hkv :].clone()
    cache = build_cos_sin_cache(rot_dim, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (t,))
    want_q, want_k = ref_rotary_embedding(positions, query, key, cache, is_neox)
    kc.rotary_embedding(positions, query, key, cache, is_neox)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)
    assert torch.equal(qkv[:, hq + hkv :], value_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [7, 16, 33, 1536])
def test_silu_and_mul(inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(inter)
    x = 4 * torch.randn(13, 2 * inter).to(dtype)
    got, want = kc.silu_and_mul(x), ref_silu_and_mul(x)
    rtol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)


def test_build_identity_and_cache() -> None:
    """The build folder names the ISA, source hash and torch version; a second load is the cached module."""
    spec = build.build_spec()
    assert spec.directory.parent == build.kvferry_home() / "torch_extensions"
    assert (
        spec.capability.lower() in spec.directory.name
        and torch.__version__.split("+")[0] in spec.directory.name
    )
    assert kc.load() is kc.load() and kc.unavailable_reason() is None
    assert build.vec_capability({"avx2", "fma", "f16c"}) in ("AVX2", "DEFAULT")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "group", "tile"), [(5, 192, 128, 32, 64), (33, 640, 256, 128, 512)])
def test_woq_int4_linear_equals_torchs_int4pack_kernel(
    m: int, n: int, k: int, group: int, tile: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tile-dequantizing GEMM on kvferry's tiles computes what torch's kernel does on its own packing."""
    monkeypatch.setattr(kc, "WOQ_TILE_ROWS", tile)  # n is not a multiple of the tile: a partial last tile
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # torch's own packing (ISA-dependent)
    sz = torch.stack([torch.rand(k // group, n) * 0.02 + 0.001, torch.randn(k // group, n) * 0.01], -1).to(
        dtype
    )
    x = torch.randn(m, k, dtype=dtype)
    expected = torch._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    ours = pack_int4_tiles(codes)  # kvferry's tiles: torch's packing on AVX-512, not on AVX2
    assert_close(kc.woq_int4_linear(x, ours, sz, group), expected, dtype)
    with torch.inference_mode():  # as the engine calls it: worker threads must write the output too
        assert_close(kc.woq_int4_linear(x, ours, sz, group), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_woq_int8_linear_equals_torchs_int8pack_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kc, "WOQ_TILE_ROWS", 48)
    q = torch.randint(-127, 128, (200, 80), dtype=torch.int8)  # K = 80: a vector tail per row
    scales = (torch.rand(200) * 0.01).to(dtype)
    x = torch.randn(17, 80, dtype=dtype)
    assert_close(kc.woq_int8_linear(x, q, scales), torch._weight_int8pack_mm(x, q, scales), dtype)
    with torch.inference_mode():
        assert_close(kc.woq_int8_linear(x, q, scales), torch._weight_int8pack_mm(x, q, scales), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k"), [(1, 96), (7, 72)])  # 7: a 4-row block and 3 single rows; 72: a tail
def test_woq_int8_gemv_is_the_int8_formula(m: int, k: int, dtype: torch.dtype) -> None:
    q = torch.randint(-127, 128, (130, k), dtype=torch.int8)
    scales = (torch.rand(130) * 0.01).to(dtype)
    x = torch.randn(m, k, dtype=dtype)
    expected = (x.float() @ (q.float() * scales.float()[:, None]).t()).to(dtype)
    assert_close(kc.woq_int8_gemv(x, q, scales), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_argmax_matches_torch_max(dtype: torch.dtype) -> None:
    """First index of the maximum per row (ties, NaN first, -inf rows, a row tail past the vector width,
    strided rows, one row of a 49k vocabulary), in the logits' own dtype, as torch.max(dim=-1)."""
    torch.manual_seed(3)
    x = torch.randn(9, 1003).to(dtype)
    x[1, 500] = x[1, 900] = x[1].max() + 1  # a tie: the first wins
    x[2, 40] = x[2, 7] = float("nan")  # NaN counts as the maximum; the first NaN wins
    x[3] = float("-inf")
    x[4, 1002] = 1e4  # in the scalar tail
    x[5, 3] = float("inf")
    for logits in (x, x[:, 1:], torch.randn(1, 49152).to(dtype)):
        assert torch.equal(kc.greedy_argmax(logits), logits.float().max(dim=-1).indices)
