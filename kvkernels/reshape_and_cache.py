"""Triton kernel that writes a step's new K/V rows into the block-paged KV cache by slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels._common import padded_dim


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program copies BLOCK_T tokens of one KV head; tokens with slot < 0 are skipped."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dim = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    mask = (slot >= 0)[:, None] & (dim < head_dim)[None, :]
    tok64 = tok.to(tl.int64)[:, None]

    k = tl.load(key_ptr + tok64 * stride_kt + head * stride_kh + dim[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + head * stride_vh + dim[None, :] * stride_vd, mask=mask)
    k_dst = key_cache_ptr + block[:, None] * stride_cb + offset[:, None] * stride_co + head * stride_ch
    v_dst = value_cache_ptr + block[:, None] * stride_vcb + offset[:, None] * stride_vco + head * stride_vch
    tl.store(k_dst + dim[None, :] * stride_cd, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + dim[None, :] * stride_vcd, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] at slots."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = padded_dim(head_dim, minimum=1)
    block_t = max(1, min(64, 4096 // block_d, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t), num_heads)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        num_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
