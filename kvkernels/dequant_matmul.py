"""Triton weight-only quantized GEMM: y = x @ dequant(W)^T (+ b), W as 4- or 8-bit codes per (row, group).

W is read as codes (uint8 [N, K // 2] with k = 2j in the low nibble of byte j and 2j + 1 in the high
one, or uint8 [N, K] for 8-bit), with a scale and an offset per (row, group): w = code * scale + offset.
An 8-bit code is an unsigned integer, or (``fp8=True``) the byte of an FP8 E4M3 number, decoded with
integer ops into its fp32 bit pattern (exact, and the same in Triton's interpreter; no NaN codes).
Each K tile lies inside one group, so a tile is dequantized in registers right after its load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels._common import dot_precision, upcast_loads


@triton.jit
def _e4m3_to_f32(code):
    """float8_e4m3fn bytes -> fp32: normals rebuilt as fp32 bits, subnormals as m * 2**-9."""
    c = code.to(tl.uint32)
    sign, exp, man = c >> 7, (c >> 3) & 15, c & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    tiny = man.to(tl.float32) * 0.001953125
    return tl.where(exp == 0, tl.where(sign == 1, -tiny, tiny), normal)


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    s_xm,
    s_qn,
    s_sn,
    s_ym,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program: one BLOCK_M x BLOCK_N output tile, accumulated in fp32 over K."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        if BITS == 4:
            byte = tl.load(q_ptr + rn[None, :] * s_qn + (rk[:, None] // 2), mask=n_ok[None, :], other=0)
            code = (byte >> ((rk[:, None] % 2) * 4).to(tl.uint8)) & 0x0F
        else:
            code = tl.load(q_ptr + rn[None, :] * s_qn + rk[:, None], mask=n_ok[None, :], other=0)
        g = k0 // GROUP
        scale = tl.load(s_ptr + rn * s_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        offset = tl.load(o_ptr + rn * s_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        if FP8:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
            value = _e4m3_to_f32(code)
        else:
            value = code.to(tl.float32)
        w = value * scale[None, :] + offset[None, :]  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * s_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def dequant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """x [M, K] (contiguous rows) times the dequantized [N, K] weight, transposed; output in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if bits not in (4, 8) or group % 16 or k % group or (fp8 and bits != 8):
        raise ValueError(
            f"dequant_matmul: bits {bits} / group {group} / K {k} not supported (4|8, group % 16 == 0)"
        )
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k = 64, next(b for b in (64, 32, 16) if group % b == 0)  # a K tile stays in one group
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if m:
        _dequant_matmul_kernel[grid](
            x,
            qweight,
            scales,
            offsets,
            bias if bias is not None else scales,
            y,
            m,
            n,
            k,
            x.stride(0),
            qweight.stride(0),
            scales.stride(0),
            y.stride(0),
            GROUP=group,
            BITS=bits,
            FP8=fp8,
            HAS_BIAS=bias is not None,
            UPCAST=upcast_loads(x.dtype),
            PRECISION=dot_precision(x.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4,
        )
    return y


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 -> uint8 [N, K // 2], k = 2j low nibble, 2j + 1 high nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)
