"""Triton causal attention of variable-length packed queries over a block-paged KV cache (prefix-aware)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvkernels._common import (
    dot_precision,
    interpreting,
    load_kv_tile,
    online_softmax_step,
    padded_dim,
    upcast_loads,
)

LOG2E = math.log2(math.e)
LOG2E_JIT: tl.constexpr = tl.constexpr(LOG2E)  # sink logits (natural log) into the kernels' base 2


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    head_dim,
    group,
    q_per_tile,
    window,
    s_qt,
    s_qh,
    s_qd,
    s_kb,
    s_ko,
    s_kh,
    s_kd,
    s_vb,
    s_vo,
    s_vh,
    s_vd,
    s_bt,
    s_ot,
    s_oh,
    s_od,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (b, tile, kv_head): rows are q_per_tile query tokens x the group's query heads. With sinks
    each row's softmax starts at (max = its head's sink, sum = 1)."""
    b, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile * q_per_tile >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len
    r, dim = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    tok = tile * q_per_tile + r // group
    row_ok = (r < q_per_tile * group) & (tok < q_len)
    q_pos = tl.minimum(context + tok, seq_len - 1)  # padding rows attend like the last token: no NaN
    heads = kv_head * group + r % group
    q_mask = row_ok[:, None] & (dim < head_dim)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * s_qt + heads[:, None] * s_qh + dim[None, :] * s_qd, mask=q_mask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_JIT
        denom = tl.full([BLOCK_M], 1.0, tl.float32)
    kv_end = context + tl.minimum((tile + 1) * q_per_tile, q_len)  # one past the tile's last position
    kv_start = tl.where(window > 0, tl.maximum(context + tile * q_per_tile - window + 1, 0), 0)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(block_tables_ptr + b * s_bt + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & (dim < head_dim)[None, :]
        k = load_kv_tile(k_cache_ptr, block, n % PAGE, kv_head, dim, kv_mask, s_kb, s_ko, s_kh, s_kd, UPCAST)
        v = load_kv_tile(v_cache_ptr, block, n % PAGE, kv_head, dim, kv_mask, s_vb, s_vo, s_vh, s_vd, UPCAST)
        in_window = (n[None, :] > q_pos[:, None] - window) | (window <= 0)
        keep = n_mask[None, :] & (n[None, :] <= q_pos[:, None]) & in_window
        m, denom, acc = online_softmax_step(q, k, v, keep, m, denom, acc, qk_scale, PRECISION)

    o = acc / denom[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * s_ot + heads[:, None] * s_oh + dim[None, :] * s_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile_config(block_d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a padded head dim; the interpreter prefers wide tiles."""
    if interpreting():
        return 64, 64, 4
    if block_d <= 64:
        return 128, 64, 4
    if block_d <= 128:
        return 128, 64, 8
    return 64, 32, 8


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, Hq, D]: each sequence's packed queries are its last q_len of seq_lens[b] positions; causal,
    and with window > 0 each query sees only its last ``window`` positions (sliding window); sinks [Hq]:
    per-head attention-sink logits added to the softmax denominator (gpt-oss).

    Pass max_query_len to avoid a host sync (it sizes the grid).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    block_d = padded_dim(head_dim)
    block_m, block_n, num_warps = _tile_config(block_d)
    block_m = max(block_m, padded_dim(group))
    q_per_tile = block_m // group
    grid = (batch, triton.cdiv(max_query_len, q_per_tile), num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        query if sinks is None else sinks.float().contiguous(),
        scale * LOG2E,
        head_dim,
        group,
        q_per_tile,
        window,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_SINKS=sinks is not None,
        UPCAST=upcast_loads(query.dtype),
        PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=2,
    )
    return out
