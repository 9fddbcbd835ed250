"""Triton multi-LoRA kernels (punica's shrink / expand pair) over rows grouped by adapter slot (segments).

Segment g is ``rows[seg_start[g]:seg_start[g + 1]]``, all under adapter slot ``seg_slot[g]``:
  shrink: s[p] = (x[rows[p]] @ a[slot]^T) * scale[slot], fp32 [P, R];
  expand: y[rows[p], c] += s[p, j * r:(j + 1) * r] @ b[slot, :, c] for the columns c of shard j.
Grid: (segment, row block, output tile). The host passes the longest segment (known when the plan is
built), so nothing waits on the device; row blocks past their segment's end exit at once. Both kernels
accumulate in fp32; expand adds into y's values and rounds once (twins: kvkernels.reference.ref_lora_*).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvkernels._common import dot_precision, padded_dim, upcast_loads


@triton.jit
def _segment_block(rows_ptr, seg_start_ptr, seg_slot_ptr, g, pid_m, BLOCK_M: tl.constexpr):
    """Row block ``pid_m`` of segment ``g``: (any row left, its slot, positions, their mask, the rows)."""
    p1 = tl.load(seg_start_ptr + g + 1)
    first = tl.load(seg_start_ptr + g) + pid_m * BLOCK_M
    slot = tl.load(seg_slot_ptr + g).to(tl.int64)
    rp = first + tl.arange(0, BLOCK_M)
    p_ok = rp < p1
    rows = tl.load(rows_ptr + rp, mask=p_ok, other=0).to(tl.int64)
    return first < p1, slot, rp, p_ok, rows


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    s_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    scale_ptr,
    K,
    R,
    s_xt,
    s_as,
    s_ar,
    s_sp,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (segment, row block, R tile): s rows = x rows @ a[slot]^T * scale[slot]."""
    g, pid_m, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    live, slot, rp, p_ok, rows = _segment_block(rows_ptr, seg_start_ptr, seg_slot_ptr, g, pid_m, BLOCK_M)
    if not live:
        return
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rr < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rows[:, None] * s_xt + rk[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(
            a_ptr + slot * s_as + rr[None, :] * s_ar + rk[:, None],
            mask=k_ok[:, None] & r_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A^T
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    acc *= tl.load(scale_ptr + slot)
    tl.store(s_ptr + rp[:, None] * s_sp + rr[None, :], acc, mask=p_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,
    s_ptr,
    b_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    col0,
    col1,
    s_col0,
    rank,
    s_yt,
    s_sp,
    s_bs,
    s_br,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (segment, row block, N tile of one shard): y[rows, cols] += s[:, shard's r] @ b[slot, :, cols]."""
    g, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    live, slot, rp, p_ok, rows = _segment_block(rows_ptr, seg_start_ptr, seg_slot_ptr, g, pid_m, BLOCK_M)
    if not live:
        return
    rn = col0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < col1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        s = tl.load(
            s_ptr + rp[:, None] * s_sp + (s_col0 + rr)[None, :], mask=p_ok[:, None] & r_ok[None, :], other=0.0
        )
        b = tl.load(
            b_ptr + slot * s_bs + rr[:, None] * s_br + rn[None, :],
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(s, b.to(tl.float32), acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * s_yt + rn[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(max_segment: int) -> int:
    """Row block: 16 for decode-sized segments, up to 64 for prefill-sized ones."""
    return min(64, padded_dim(max_segment))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    scale: torch.Tensor,
    max_segment: int,
) -> torch.Tensor:
    """s [P, R] fp32 = (x[rows[p]] @ a[slot]^T) * scale[slot]; x [T, K] (unit stride along K), a [S, R, K]."""
    assert x.stride(1) == 1 and a.is_contiguous() and a.shape[2] == x.shape[1]
    num, rank_rows, k = rows.shape[0], a.shape[1], x.shape[1]
    s = torch.empty(num, rank_rows, dtype=torch.float32, device=x.device)
    if num == 0:
        return s
    block_m, block_r, block_k = _block_m(max_segment), min(64, padded_dim(rank_rows)), 64
    grid = (seg_slot.shape[0], triton.cdiv(max_segment, block_m), triton.cdiv(rank_rows, block_r))
    _shrink_kernel[grid](
        x, a, s, rows, seg_start, seg_slot, scale, k, rank_rows,
        x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        UPCAST=upcast_loads(x.dtype), PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return s


def lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    shard_cols: Sequence[int],
    max_segment: int,
) -> None:
    """In place: y[rows[p], c] += s[p, j * r:(j + 1) * r] @ b[slot, :, c] for shard j's columns
    ``shard_cols[j]:shard_cols[j + 1]``; y [T, N] (unit stride along N), s [P, shards * r] fp32, b [S, r, N]."""
    assert y.stride(1) == 1 and b.is_contiguous() and s.is_contiguous() and b.shape[2] == y.shape[1]
    if rows.shape[0] == 0:
        return
    rank = b.shape[1]
    block_m, block_n, block_r = _block_m(max_segment), 64, min(64, padded_dim(rank))
    for j, (c0, c1) in enumerate(zip(shard_cols, shard_cols[1:], strict=False)):
        grid = (seg_slot.shape[0], triton.cdiv(max_segment, block_m), triton.cdiv(c1 - c0, block_n))
        _expand_kernel[grid](
            y, s, b, rows, seg_start, seg_slot, c0, c1, j * rank, rank,
            y.stride(0), s.stride(0), b.stride(0), b.stride(1),
            PRECISION=dot_precision(torch.float32),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        )  # fmt: skip
