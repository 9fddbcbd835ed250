"""Triton SiLU-and-mul: silu(gate) * up for the fused [gate | up] MLP projection."""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_tokens,
    inter,
    s_xt,
    s_xc,
    s_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Program (token tile, column tile): out = silu(x[:, :I]) * x[:, I:] in fp32."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_tokens)[:, None] & (cols < inter)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * s_xt + cols[None, :] * s_xc
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter * s_xc, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * s_ot + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:] of shape [T, I], in x.dtype."""
    num_tokens, width = x.shape
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_i = min(1024, triton.next_power_of_2(inter))
    block_t = max(1, min(16, 4096 // block_i, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](
        x, out, num_tokens, inter, *x.stride(), out.stride(0), BLOCK_T=block_t, BLOCK_I=block_i
    )
    return out
