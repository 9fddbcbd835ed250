"""Shared checks of kvkernels.cpu's paged attention against kvkernels/reference.py: random mixed batches,
sliding windows with poisoned blocks before them, and cascade runs over shared prefixes."""

from __future__ import annotations

import random

import torch
from kernel_testlib import TOLERANCE, assert_close, empty_cache, make_paged_kv

import kvkernels.cpu as kc
from kvkernels.reference import ref_paged_prefill_attention

# Relative Frobenius error allowed vs the fp32 reference (the bf16 reference rounds its output too).
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


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
    window: int = 0,
    sinks: bool = False,
) -> None:
    """batch: (q_len, seq_len) per sequence, packed in order; extra_rows trailing rows belong to none.

    window > 0: sliding-window attention; the blocks no query of the batch may see are NaN-poisoned
    (a freed block can hold anything), so reading one fails the comparison. sinks: random gpt-oss
    attention sinks [Hq] (fp32 logits, whatever the cache dtype)."""
    torch.manual_seed(seed)
    kv = make_paged_kv([n for _, n in batch], bs, hkv, d, dtype, "cpu")
    starts = [0]
    for q_len, _ in batch:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32)
    query = torch.randn(starts[-1] + extra_rows, hq, d, dtype=dtype)
    out = torch.empty_like(query)  # NaN-poisoned by conftest: every element must be written
    scale = d**-0.5
    sink = torch.randn(hq) * 2 if sinks else None
    expected = ref_paged_prefill_attention(
        query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, scale, window, sink
    )
    if window > 0:
        poison_outside_window(kv.key_cache, kv.value_cache, kv.block_tables, batch, bs, window)
    kc.paged_attention(
        out,
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        qsl,
        kv.seq_lens,
        scale,
        split_tokens,
        window,
        sinks=sink,
    )
    assert_close(out, expected, dtype, scale=ATTN_TOL[dtype] / TOLERANCE[dtype])


def poison_outside_window(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    batch: list[tuple[int, int]],
    bs: int,
    window: int,
) -> None:
    """NaN into every block of a sequence that lies wholly before the window of its first query."""
    for b, (q_len, seq_len) in enumerate(batch):
        if q_len == 0:
            continue
        first_seen = max(0, seq_len - q_len - window + 1)
        dead = table[b, : first_seen // bs].long()
        key_cache[dead] = float("nan")
        value_cache[dead] = float("nan")


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
def run_inputs(
    groups: list[tuple[int, list[int]]], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """(query, key cache, value cache, block table, query_start_loc, seq_lens) of decode rows in groups
    that each share their first blocks (shared blocks, tails per row), a prefill row and a row of its
    own between the groups; blocks shuffled, unused table entries NaN."""
    torch.manual_seed(seed)
    bs = 16
    specs: list[tuple[int, int, int]] = []  # (q_len, group or -1, length past the group's prefix)
    for g, (_, tails) in enumerate(groups):
        specs += [(1, g, t) for t in tails] + [(40, -1, 70), (1, -1, 150)]
    own = [-(-t // bs) for _, _, t in specs]
    shared = [n for n, _ in groups]
    num_blocks = sum(shared) + sum(own) + 1
    _, key_cache, value_cache = empty_cache(num_blocks, bs, hkv, d, dtype, "cpu")
    key_cache[:-1] = torch.randn(key_cache[:-1].shape, dtype=dtype)
    value_cache[:-1] = torch.randn(value_cache[:-1].shape, dtype=dtype)
    order = torch.randperm(num_blocks - 1, dtype=torch.int32).tolist()
    prefix_ids = [[order.pop() for _ in range(n)] for n in shared]
    table = torch.full((len(specs), max(shared) + max(own)), num_blocks - 1, dtype=torch.int32)
    lens = []
    for b, ((_, g, t), n) in enumerate(zip(specs, own, strict=True)):
        ids = (prefix_ids[g] if g >= 0 else []) + [order.pop() for _ in range(n)]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        lens.append((shared[g] * bs if g >= 0 else 0) + t)
    starts = [0]
    for q_len, _, _ in specs:
        starts.append(starts[-1] + q_len)
    qsl, seq_lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    return torch.randn(starts[-1], hq, d, dtype=dtype), key_cache, value_cache, table, qsl, seq_lens


def check_runs(
    groups: list[tuple[int, list[int]]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """The cascade path on run_inputs' batch equals the reference (sinks: with these attention sinks)."""
    query, key_cache, value_cache, table, qsl, seq_lens = run_inputs(groups, hq, hkv, d, dtype, seed)
    out = torch.empty_like(query)
    kc.paged_attention(
        out, query, key_cache, value_cache, table, qsl, seq_lens, d**-0.5, cascade=True, sinks=sinks
    )
    expected = ref_paged_prefill_attention(
        query, key_cache, value_cache, table, qsl, seq_lens, d**-0.5, sinks=sinks
    )
    assert_close(out, expected, dtype, scale=ATTN_TOL[dtype] / TOLERANCE[dtype])
