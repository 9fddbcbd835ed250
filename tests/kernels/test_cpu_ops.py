"""kvkernels.cpu (the C++ CPU extension) vs kvkernels/reference.py: paged attention (mixed batches, decode kernels,
splits, shared prefixes, sliding windows, bad metadata)."""

from __future__ import annotations

import random
import zlib
from types import ModuleType

import pytest
import torch
from cpu_attention_testlib import (
    ATTN_TOL,
    check_attention,
    check_runs,
    mixed_batch,
    run_inputs,
)
from kernel_testlib import TOLERANCE, assert_close, empty_cache, make_paged_kv

import kvkernels.cpu as kc
from kvkernels.cpu import build
from kvkernels.reference import ref_paged_prefill_attention

pytestmark = pytest.mark.usefixtures("ops")  # every test needs the compiled extension (conftest)

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


def test_decode_kernel_choice_follows_the_cpu(ops: ModuleType) -> None:
    """The AVX512-BF16 decode kernel is compiled in exactly when a native AVX-512 build has avx512_bf16;
    the AMX one only on top of it, with amx_tile and amx_bf16 (and the OS granting the tile state)."""
    spec = build.build_spec()
    native = spec.capability == "AVX512" and "-march=native" in spec.cflags
    assert ops.has_bf16_dot_decode == (native and "avx512_bf16" in spec.flags)
    if ops.has_amx_decode:
        assert ops.has_bf16_dot_decode and {"amx_tile", "amx_bf16"} <= set(spec.flags)
    with pytest.raises(RuntimeError, match="auto"):
        ops._set_decode_kernel("fastest")


# (Hq, Hkv, D): G = 1, 3, 4, 8, 16 and head dims that are / are not multiples of the 32-element bf16
# slices; 8 kv heads x G = 8 and 2 x 16 exceed one 16-column AMX score tile (several head groups).
DECODE_SHAPES = [
    (4, 4, 64),
    (9, 3, 64),
    (8, 2, 128),
    (16, 2, 80),
    (6, 6, 24),
    (8, 1, 16),
    (64, 8, 64),
    (32, 2, 96),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "hq{}-hkv{}-d{}".format(*s))
def test_paged_attention_decode_kernels(
    shape: tuple[int, int, int], dtype: torch.dtype, decode_kernel: str
) -> None:
    """Decode rows of every tile remainder (1..17 keys, chunk boundaries at 64), long rows, one prefill."""
    hq, hkv, d = shape
    seed = zlib.crc32(repr((shape, dtype, decode_kernel)).encode())
    batch = [(1, n) for n in (1, 2, 15, 16, 17, 63, 64, 65, 129, 700)] + [(5, 40)]
    check_attention(batch, hq, hkv, d, 16, dtype, seed)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_paged_attention_decode_block_sizes(block_size: int, decode_kernel: str) -> None:
    """Tiles of 16 keys that span blocks (block_size < 16: no evenly strided tile, the AVX-512 scores
    take them) or lie inside one block (32), and forced splits that start mid-tile."""
    batch = [(1, n) for n in (16, 33, 200, 517)]
    check_attention(batch, 12, 4, 64, block_size, torch.bfloat16, 81 + block_size)
    check_attention(batch, 12, 4, 64, block_size, torch.bfloat16, 91 + block_size, split_tokens=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode_g1_many_keys(dtype: torch.dtype, decode_kernel: str) -> None:
    """G = 1 (no GQA), a batch of long decode rows (one item per row, no splits) and a forced split run."""
    lens = [1500, 1337, 2048, 999, 1024, 1601, 777, 1900]
    check_attention([(1, n) for n in lens], 6, 6, 64, 16, dtype, 51)
    check_attention([(1, n) for n in lens[:3]], 4, 4, 64, 32, dtype, 52, split_tokens=500)


def test_paged_attention_long_context_auto_splits(decode_kernel: str) -> None:
    """One 4000-token decode row on 2 threads: kv splits (block-misaligned length) and the reduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_attention([(1, 4001)], 12, 12, 64, 16, torch.bfloat16, 61)
        check_attention([(1, 3000), (1, 2500)], 8, 2, 64, 16, torch.float32, 62)
    finally:
        torch.set_num_threads(threads)


def check_shared_prefix(
    tails: list[int],
    shared_blocks: int,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int,
    prefill: tuple[int, int] | None = None,
    split_tokens: int = 0,
    cascade: bool = True,
) -> None:
    """Decode rows whose block tables all start with the same shared_blocks blocks (prefix caching), then
    `tail` positions in blocks of their own; a row of distinct blocks and an optional prefill row
    (q_len, seq_len) ride along. Unused table entries point at a NaN block."""
    torch.manual_seed(seed)
    rows = [(1, shared_blocks * bs + t) for t in tails] + [(1, shared_blocks * bs + 7)]
    if prefill is not None:
        rows.append(prefill)
    own = [-(-t // bs) for t in tails] + [shared_blocks + 1] + ([-(-prefill[1] // bs)] if prefill else [])
    num_blocks = shared_blocks + sum(own) + 1
    cache, key_cache, value_cache = empty_cache(num_blocks, bs, hkv, d, dtype, "cpu")
    key_cache[:-1] = torch.randn(key_cache[:-1].shape, dtype=dtype)
    value_cache[:-1] = torch.randn(value_cache[:-1].shape, dtype=dtype)
    order = torch.randperm(num_blocks - 1, dtype=torch.int32)
    width = max(own) + shared_blocks + 1
    table = torch.full((len(rows), width), num_blocks - 1, dtype=torch.int32)  # the NaN block
    used = shared_blocks
    for b, n in enumerate(own):
        first = shared_blocks if b < len(tails) else 0
        if b < len(tails):
            table[b, :shared_blocks] = order[:shared_blocks]
        table[b, first : first + n] = order[used : used + n]
        used += n
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    starts = [0]
    for q_len, _ in rows:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32)
    query = torch.randn(starts[-1], hq, d, dtype=dtype)
    out = torch.empty_like(query)
    scale = d**-0.5
    kc.paged_attention(
        out, query, key_cache, value_cache, table, qsl, lens, scale, split_tokens, cascade=cascade
    )
    expected = ref_paged_prefill_attention(query, key_cache, value_cache, table, qsl, lens, scale)
    assert_close(out, expected, dtype, scale=ATTN_TOL[dtype] / TOLERANCE[dtype])


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "per-row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_shared_prefix(dtype: torch.dtype, decode_kernel: str, cascade: bool) -> None:
    """Shared-prefix decode batches: short tails (one range per row, kv heads in L2-sized groups), long
    tails (cut at the end of the prefix, combined by the reduce), a fully shared row (tail 0), GQA,
    a prefill row in the batch, forced splits, 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_shared_prefix([32, 17, 1, 40] * 4, 32, 12, 12, 64, 16, dtype, 71, cascade=cascade)
        check_shared_prefix(
            [900, 1, 0, 333, 1200], 8, 9, 3, 64, 16, dtype, 72, prefill=(30, 90), cascade=cascade
        )
        check_shared_prefix([5, 100, 64], 4, 16, 2, 128, 32, dtype, 73, split_tokens=48, cascade=cascade)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_cascades_by_default_only_where_amx_runs(dtype: torch.dtype) -> None:
    """cascade=None (the default) takes the cascade path for bf16 caches where the AMX decode kernel runs,
    and attends row by row elsewhere (no gain without AMX): bit-equal to that explicit choice."""
    query, key_cache, value_cache, table, qsl, seq_lens = run_inputs(
        [(32, [1 + i % 40 for i in range(50)])], 12, 2, 64, dtype, 85
    )
    outs = {}
    for cascade in (None, True, False):
        outs[cascade] = torch.empty_like(query)
        kc.paged_attention(
            outs[cascade], query, key_cache, value_cache, table, qsl, seq_lens, 0.125, cascade=cascade
        )
    assert not torch.equal(outs[True], outs[False])  # the two paths round differently on this batch
    amx = dtype == torch.bfloat16 and bool(kc.load().has_amx_decode)
    assert torch.equal(outs[None], outs[amx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_cascade_runs(dtype: torch.dtype, decode_kernel: str) -> None:
    """Cascade runs: two groups with different prefixes (cut apart by prefill and unshared rows), a run of
    more query rows than one cascade item takes (sub-runs), G = 1 / 3 / 6, head dims 64 / 80 / 128, tails
    0 (the row's positions all shared), inside a block and many blocks long, 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            check_runs([(8, [1, 33, 0, 200]), (5, [16, 7])], 12, 2, 64, dtype, 81)
            check_runs([(32, [1 + i % 40 for i in range(50)])], 12, 2, 64, dtype, 82)  # 300 rows
            check_runs([(4, [9, 90, 3])], 9, 3, 80, dtype, 83)
            check_runs([(6, [2, 50, 17])], 8, 8, 128, dtype, 84)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 33, 200])
def test_paged_attention_sliding_window(dtype: torch.dtype, window: int, decode_kernel: str) -> None:
    """Sliding windows (1 token, inside one block, a block, across blocks, wider than most rows) over
    mixed batches: decode rows, prefill chunks longer than the window, forced decode splits; blocks
    before the window are NaN and must never be read."""
    rng = random.Random(window)
    batch = mixed_batch(rng, 9, 300) + [(1, 517), (120, 400), (64, 64)]
    check_attention(batch, 8, 2, 64, 16, dtype, 90 + window, window=window)
    check_attention(batch, 12, 3, 80, 16, dtype, 91 + window, split_tokens=48, window=window)


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
