"""kernels.cpu (the C++ CPU extension) vs kernels/reference.py: paged attention, cache writes, pointwise ops."""

from __future__ import annotations

import random
import zlib
from types import ModuleType

import pytest
import torch
from kernel_testlib import TOLERANCE, assert_close, empty_cache, make_paged_kv

import kernels.cpu as kc
from kernels.cpu import build
from kernels.reference import (
    build_cos_sin_cache,
    ref_paged_prefill_attention,
    ref_reshape_and_cache,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)

# Relative Frobenius error allowed vs the fp32 reference (the bf16 reference rounds its output too).
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def ops() -> ModuleType:
    """The compiled extension; every test here is skipped (with the reason) when it cannot be built."""
    module = kc.load()
    if module is None:
        pytest.skip(f"kernels.cpu unavailable: {kc.unavailable_reason()}")
    return module


def check_attention(
    batch: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int,
    split_tokens: int = 0,
    extra_rows: int = 0,
) -> None:
    """batch: (q_len, seq_len) per sequence, packed in order; extra_rows trailing rows belong to none."""
    torch.manual_seed(seed)
    kv = make_paged_kv([n for _, n in batch], bs, hkv, d, dtype, "cpu")
    starts = [0]
    for q_len, _ in batch:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32)
    query = torch.randn(starts[-1] + extra_rows, hq, d, dtype=dtype)
    out = torch.empty_like(query)  # NaN-poisoned by conftest: every element must be written
    scale = d**-0.5
    kc.paged_attention(
        out, query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, scale, split_tokens
    )
    expected = ref_paged_prefill_attention(
        query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, scale
    )
    assert_close(out, expected, dtype, scale=ATTN_TOL[dtype] / TOLERANCE[dtype])


def mixed_batch(rng: random.Random, n: int, max_len: int) -> list[tuple[int, int]]:
    """Ragged decode rows, prefill chunks over a cached prefix, fresh prefills and an idle sequence."""
    rows = []
    for i in range(n):
        seq_len = rng.randint(1, max_len)
        kind = i % 4
        q_len = 1 if kind in (0, 1) else seq_len if kind == 2 else rng.randint(2, max(2, seq_len // 2))
        rows.append((min(q_len, seq_len), seq_len))
    rows.insert(rng.randrange(len(rows)), (0, rng.randint(1, max_len)))  # cached, nothing to compute now
    return rows


# (Hq, Hkv, D, block_size): GQA groups 1/3/4/8, head dims 64/80/128 and small odd ones, blocks 1/16/32.
SHAPES = [
    (4, 4, 64, 16),
    (9, 3, 64, 16),
    (8, 2, 80, 32),
    (16, 2, 128, 16),
    (8, 2, 24, 1),
    (3, 1, 16, 32),
    (12, 3, 128, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
def test_paged_attention_mixed_batch(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    hq, hkv, d, bs = shape
    seed = zlib.crc32(repr((shape, dtype)).encode())  # a different draw per case, the same every run
    rng = random.Random(seed)
    check_attention(mixed_batch(rng, 7, 150), hq, hkv, d, bs, dtype, seed, extra_rows=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_prefill_tiles(dtype: torch.dtype) -> None:
    """Long query runs span several query tiles and diagonal kv tiles; one chunk starts mid-block."""
    check_attention([(200, 200), (70, 333), (1, 90)], 8, 8, 64, 16, dtype, 11)
    check_attention([(150, 150), (33, 77)], 9, 3, 80, 16, dtype, 12)


@pytest.mark.parametrize("split_tokens", [64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_forced_split_kv(split_tokens: int, dtype: torch.dtype) -> None:
    """Long decodes cut into kv ranges (block-misaligned too) and combined by the reduce pass."""
    batch = [(1, 1200), (1, 65), (1, 700), (20, 300), (1, 1)]
    check_attention(batch, 8, 2, 64, 16, dtype, 21 + split_tokens, split_tokens=split_tokens)


def test_paged_attention_auto_split_and_head_groups() -> None:
    """Few work items for the threads: long decodes split by kv range, short ones by kv heads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_attention([(1, 1300)], 12, 4, 64, 16, torch.float32, 31)  # 4 kv splits
        check_attention([(1, 300)], 12, 4, 64, 16, torch.float32, 32)  # kv heads in groups
        check_attention([(40, 100)], 12, 4, 64, 16, torch.float32, 33)  # prefill heads in groups
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_empty_sequences_write_zeros() -> None:
    """seq_len 0 with q_len 0, rows owned by no sequence, and an empty batch leave zeros, as the reference."""
    check_attention([(0, 0), (1, 17), (0, 5)], 4, 2, 64, 16, torch.float32, 41, extra_rows=3)
    kv = make_paged_kv([16], 16, 2, 64, torch.float32, "cpu")
    out = torch.empty(2, 4, 64)
    kc.paged_attention(
        out,
        torch.randn(2, 4, 64),
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        torch.tensor([0, 0], dtype=torch.int32),
        kv.seq_lens,
        0.125,
    )
    assert torch.equal(out, torch.zeros_like(out))


def test_paged_attention_rejects_bad_metadata() -> None:
    kv = make_paged_kv([8], 16, 2, 64, torch.float32, "cpu")
    q = torch.randn(9, 4, 64)
    with pytest.raises(RuntimeError, match="shorter than"):
        kc.paged_attention(
            torch.empty_like(q),
            q,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            torch.tensor([0, 9], dtype=torch.int32),
            kv.seq_lens,
            0.125,
        )
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        q3 = torch.randn(1, 3, 64)
        kc.paged_attention(
            torch.empty_like(q3),
            q3,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            torch.tensor([0, 1], dtype=torch.int32),
            kv.seq_lens,
            0.125,
        )


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
