"""Triton fused RMSNorm (HF Llama rounding), optionally adding a residual first."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    hidden,
    eps,
    s_xr,
    s_xc,
    s_rr,
    s_rc,
    s_or,
    s_ror,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program: BLOCK_T whole rows. Normalize in fp32, round to the input dtype, then times weight."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows[:, None] * s_xr + cols[None, :] * s_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * s_rr + cols[None, :] * s_rc, mask=mask, other=0.0)
        r = (x + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * s_ror + cols[None, :], r, mask=mask)
        x = r.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / hidden + eps)
    normed = (x * inv_rms[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * s_or + cols[None, :],
        (normed * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * (x / rms(x)) for x [T, H]; with residual returns (rms_norm(x + residual), x + residual)."""
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res_in = residual if residual is not None else x
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, 4096 // block_h, triton.next_power_of_2(max(num_rows, 1))))
    if num_rows:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
            x,
            res_in,
            weight,
            out,
            res_out,
            num_rows,
            hidden,
            eps,
            *x.stride(),
            *res_in.stride(),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            num_warps=max(1, min(16, block_t * block_h // 512)),
        )
    return (out, res_out) if residual is not None else out
