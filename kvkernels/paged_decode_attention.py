"""Triton split-K (flash-decoding) paged attention for one query token per sequence, with a reduce pass."""

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
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    head_dim,
    group,
    num_heads,
    num_splits,
    window,
    s_qb,
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
    s_ob,
    s_oh,
    s_od,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (b, kv_head, split): all query heads of the group over one slice of the context. With
    sinks, split 0 starts its softmax at (max = sink, sum = 1): the sink's mass joins one split only."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # sliding window: the last `window`
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    g, dim = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    q_mask = (g < group)[:, None] & (dim < head_dim)[None, :]
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dim[None, :] * s_qd, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=g < group, other=0.0).to(tl.float32) * LOG2E_JIT
        m = tl.where(split == 0, sink, m)
        denom = tl.where(split == 0, 1.0, denom)
    for start_n in range(start, end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(block_tables_ptr + b * s_bt + n // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & (dim < head_dim)[None, :]
        k = load_kv_tile(k_cache_ptr, block, n % PAGE, kv_head, dim, kv_mask, s_kb, s_ko, s_kh, s_kd, UPCAST)
        v = load_kv_tile(v_cache_ptr, block, n % PAGE, kv_head, dim, kv_mask, s_vb, s_vo, s_vh, s_vd, UPCAST)
        keep = n_mask[None, :]
        m, denom, acc = online_softmax_step(q, k, v, keep, m, denom, acc, qk_scale, PRECISION)

    o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + b * s_ob + heads[:, None] * s_oh + dim[None, :] * s_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (b * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + dim[None, :], o, mask=(g < group)[:, None])
        lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g < group)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    head_dim,
    num_heads,
    num_splits,
    s_ob,
    s_oh,
    s_od,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (b, head): merge the splits' partial outputs, weighted by their log2-sum-exp."""
    b, head = tl.program_id(0), tl.program_id(1)
    sp, dim = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    row = (b * num_heads + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < num_splits, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + row[:, None] * BLOCK_D + dim[None, :], mask=(sp < num_splits)[:, None], other=0.0
    )
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(
        out_ptr + b * s_ob + head * s_oh + dim * s_od, o.to(out_ptr.dtype.element_ty), mask=dim < head_dim
    )


def choose_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = 64
) -> int:
    """Enough (b, kv_head, split) programs to fill the device twice, but >= 4 key tiles per split."""
    want = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    useful = triton.cdiv(max_seq_len, 4 * block_n)
    return max(1, min(want, useful, 64))


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [B, Hq, D]: query [B, Hq, D] attends to its first seq_lens[b] cached positions (GQA, split-K);
    window > 0: to the last ``window`` of them only (sliding-window attention); sinks [Hq]: per-head
    attention-sink logits added to the softmax denominator (gpt-oss).

    With num_splits=None it is chosen from the longest context; pass max_seq_len to avoid a host sync.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = padded_dim(head_dim)
    block_n = 64 if block_d <= 128 or interpreting() else 32
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else int(seq_lens.max().item()) if batch else 0
        span = min(longest, window) if window > 0 else longest
        num_splits = choose_num_splits(batch, num_kv_heads, span, _num_sms(query.device), block_n)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    part_out = torch.empty((batch, num_heads, num_splits, block_d), device=query.device, dtype=torch.float32)
    part_lse = torch.empty((batch, num_heads, num_splits), device=query.device, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        query if sinks is None else sinks.float().contiguous(),
        part_out,
        part_lse,
        scale * LOG2E,
        head_dim,
        group,
        num_heads,
        num_splits,
        window,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        PAGE=page,
        BLOCK_G=padded_dim(group),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=num_splits == 1,
        HAS_SINKS=sinks is not None,
        UPCAST=upcast_loads(query.dtype),
        PRECISION=dot_precision(query.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            head_dim,
            num_heads,
            num_splits,
            *out.stride(),
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
