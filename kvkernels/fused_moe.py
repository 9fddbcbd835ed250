"""Triton fused Mixture-of-Experts MLP: routed tokens through two grouped GEMMs (gate/up + SiLU, down).

out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])), e = topk_ids[t, k].

The T * K (token, slot) rows are sorted by expert and each expert's group is padded to a multiple of
BLOCK_M (``moe_align_block_size``), so every BLOCK_M row block belongs to one expert and both GEMMs run
as one launch each over all experts: kernel 1 computes gate and up for a block of rows against its
expert's w13 and applies SiLU-and-mul in the epilogue; kernel 2 multiplies by the expert's w2 and the
routing weight. Experts with no tokens own no block; the row blocks past the padded total (the
bound is sized on the host without a device sync) exit at once; padded rows are masked.

Numerics: fp32 accumulation in both GEMMs; the silu(gate) * up activation is rounded to x's dtype
(as vLLM and the HF MLP do); kernel 2 writes each row's weighted fp32 result to a [T, K, H] buffer,
which is summed over K in fp32 (deterministic: no atomics) and rounded to x's dtype once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvkernels._common import dot_precision, interpreting, upcast_loads


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes and launch options shared by both grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Picked by the expected rows per expert (T * K / E): decode-sized groups get thin M tiles (weight
# streaming dominates), prefill-sized ones wide tiles (weights reused across more rows). All stages'
# buffers fit sm_90's 227 KiB of shared memory even for fp32: (BM * BK + 2 * BK * BN) * 4 * stages
# <= 192 KiB (ptxas reports <= 128 KiB, no spills: tests/kernels/sm90_compile_check.py). Untuned.
CONFIGS = (
    MoEConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=4),
    MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4),
    MoEConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
    MoEConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3),
)


def choose_config(num_tokens: int, topk: int, num_experts: int) -> MoEConfig:
    """The smallest M tile holding an expert's expected rows (T * K / E), at most the widest config."""
    rows_per_expert = num_tokens * topk / max(1, num_experts)
    return next((c for c in CONFIGS if c.block_m >= rows_per_expert), CONFIGS[-1])


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T * K routed rows by expert, each group padded to a multiple of block_m.

    Returns (sorted_ids, expert_ids, num_tokens_post_padded), all int32 on topk_ids' device:
      sorted_ids [num_blocks * block_m]: row indices t * K + k, expert 0's first (ascending within
        an expert), each expert's group followed by the sentinel T * K up to a block_m multiple; the
        slots past the padded total hold the sentinel too.
      expert_ids [num_blocks]: the expert of each block_m block; -1 for blocks past the padded total.
      num_tokens_post_padded [1]: the padded total, sum_e ceil(count_e / block_m) * block_m.
    num_blocks is a host-side bound, (N + min(E, N) * (block_m - 1)) / block_m rounded up for N = T * K
    rows (each expert that has a row pads at most block_m - 1), so nothing here waits on the device.
    """
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    dev = flat.device
    num_blocks = triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = blocks_per_expert.cumsum(0)
    padded_starts = (block_ends - blocks_per_expert) * block_m
    starts = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, ascending inside a group
    expert_of_sorted = flat[order]
    rank = torch.arange(num_rows, device=dev) - starts[expert_of_sorted]
    sorted_ids = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, padded_starts[expert_of_sorted] + rank, order.to(torch.int32))
    blocks = torch.arange(num_blocks, device=dev)
    expert_ids = torch.searchsorted(block_ends, blocks, right=True)  # experts whose blocks end <= b
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_post_padded = (block_ends[-1:] * block_m).to(torch.int32)
    return sorted_ids, expert_ids, num_post_padded


@triton.jit
def _round_bf16_rne(v):
    """fp32 -> the fp32 value of its round-to-nearest-even bf16 (the interpreter's bf16 cast truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    h_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_rows,
    inter,
    hidden,
    topk,
    s_xt,
    s_we,
    s_wn,
    s_ht,
    EVEN_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, I tile): h = silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T) for the block's rows."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the padded total: no rows here
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows  # the padding sentinel is num_rows
    tokens = rows // topk
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = rn < inter
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * s_xt + rk[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * s_we + rn[None, :] * s_wn + rk[:, None]  # [BLOCK_K, BLOCK_N], K contiguous
    u_ptrs = g_ptrs + inter * s_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < hidden - k0
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALED and not UPCAST:  # int8 codes: exact in x's dtype; the row scales come after the sums
            wg, wu = wg.to(x.dtype), wu.to(x.dtype)
        if UPCAST:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALED:
        scales = scale_ptr + expert * 2 * inter + rn
        acc_g *= tl.load(scales, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u *= tl.load(scales + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if ROUND_BF16:
        h = _round_bf16_rne(h)
    tl.store(
        h_ptr + rows[:, None] * s_ht + rn[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _moe_down_kernel(
    h_ptr,
    w_ptr,
    scale_ptr,
    y_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_rows,
    hidden,
    inter,
    s_ht,
    s_we,
    s_wn,
    s_yr,
    EVEN_K: tl.constexpr,
    SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, H tile): y[row] = topk_weight[row] * (h[row] @ w2[e]^T), stored in fp32."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = rn < hidden
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * s_ht + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * s_we + rn[None, :] * s_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk < inter - k0
            h = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALED and not UPCAST:
            w = w.to(h.dtype)
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALED:
        acc *= tl.load(scale_ptr + expert * hidden + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    tl.store(y_ptr + rows[:, None] * s_yr + rn[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed MoE MLP (see the module docstring): x [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], topk_weights [T, K] (used as given), topk_ids [T, K] in [0, E) -> [T, H] in x's dtype.
    With w13_scale [E, 2I] and w2_scale [E, H], w13 / w2 are int8 codes and each GEMM's sums are scaled
    per (expert, output row) before the epilogue.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    if (
        w13.shape != (num_experts, 2 * inter, hidden)
        or w2.shape != (num_experts, hidden, inter)
        or topk_weights.shape != topk_ids.shape
        or topk_ids.shape[0] != num_tokens
        or (w13_scale is None) != (w2_scale is None)
        or w13.dtype != (x.dtype if w13_scale is None else torch.int8)
        or w2.dtype != (x.dtype if w2_scale is None else torch.int8)
        or (w13_scale is not None and w13_scale.shape != (num_experts, 2 * inter))
        or (w2_scale is not None and w2_scale.shape != (num_experts, hidden))
    ):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, "
            f"w2 {tuple(w2.shape)} {w2.dtype}, topk {tuple(topk_weights.shape)}/{tuple(topk_ids.shape)} "
            "do not match x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, K] of one dtype (or int8 "
            "w13 / w2 with scales [E, 2I] / [E, H])"
        )
    if num_tokens == 0 or topk == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for the engine's weights
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_rows = num_tokens * topk
    cfg = choose_config(num_tokens, topk, num_experts)
    sorted_ids, expert_ids, _ = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    h = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_tokens, topk, hidden), dtype=torch.float32, device=x.device)
    common = {
        "UPCAST": upcast_loads(x.dtype),
        "PRECISION": dot_precision(x.dtype),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    num_blocks = expert_ids.numel()
    scaled = w13_scale is not None
    s13 = w13_scale.contiguous() if w13_scale is not None else weights  # unused when not scaled
    s2 = w2_scale.contiguous() if w2_scale is not None else weights
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x,
        w13,
        s13,
        h,
        sorted_ids,
        expert_ids,
        num_rows,
        inter,
        hidden,
        topk,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        EVEN_K=hidden % cfg.block_k == 0,
        ROUND_BF16=interpreting() and x.dtype == torch.bfloat16,
        SCALED=scaled,
        **common,
    )
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        h,
        w2,
        s2,
        y,
        weights,
        sorted_ids,
        expert_ids,
        num_rows,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(1),
        EVEN_K=inter % cfg.block_k == 0,
        SCALED=scaled,
        **common,
    )
    return y.sum(dim=1).to(x.dtype)
