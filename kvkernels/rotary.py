"""Triton rotary position embedding (neox rotate-half or GPT-J interleaved) for query and key."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    pos_ptr,
    x_ptr,
    cache_ptr,
    out_ptr,
    num_tokens,
    half,
    s_xt,
    s_xh,
    s_xd,
    s_ot,
    s_oh,
    s_od,
    s_c,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (token tile, head): rotate the first 2 * half dims in fp32 by the cached cos/sin."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_R)
    mask = (tok < num_tokens)[:, None] & (i < half)[None, :]
    pos = tl.load(pos_ptr + tok, mask=tok < num_tokens, other=0).to(tl.int64)
    cos = tl.load(cache_ptr + pos[:, None] * s_c + i[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos[:, None] * s_c + half + i[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        d1 = i
        d2 = i + half
    else:
        d1 = 2 * i
        d2 = 2 * i + 1
    tok64 = tok.to(tl.int64)[:, None]
    x_row = x_ptr + tok64 * s_xt + head * s_xh
    x1 = tl.load(x_row + d1[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + d2[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + tok64 * s_ot + head * s_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + d1[None, :] * s_od, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(o_row + d2[None, :] * s_od, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _rotate(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotated copy of x [T, H, D]; dims past the cache's rotary dim are copied unchanged."""
    num_tokens, num_heads, head_dim = x.shape
    rot_dim = cos_sin_cache.shape[1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if rot_dim < head_dim:
        out[..., rot_dim:] = x[..., rot_dim:]
    if num_tokens == 0:
        return out
    block_r = triton.next_power_of_2(rot_dim // 2)
    block_t = max(1, min(64, 2048 // block_r, triton.next_power_of_2(num_tokens)))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        positions,
        x,
        cos_sin_cache,
        out,
        num_tokens,
        rot_dim // 2,
        *x.stride(),
        *out.stride(),
        cos_sin_cache.stride(0),
        IS_NEOX=is_neox,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
    )
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated query [T, Hq, D], rotated key [T, Hkv, D]); cos_sin_cache [max_pos, rot_dim] = [cos | sin]."""
    assert cos_sin_cache.stride(1) == 1 and cos_sin_cache.shape[1] % 2 == 0
    return _rotate(positions, query, cos_sin_cache, is_neox), _rotate(positions, key, cos_sin_cache, is_neox)
