"""Small host-side helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


def upcast_loads(dtype: torch.dtype) -> bool:
    """Compute in fp32 right after each load: always for fp32, and for every dtype in the interpreter.

    The interpreter mishandles bf16 arithmetic; on a GPU 16-bit operands go to tl.dot as they are.
    """
    return dtype == torch.float32 or interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 products for fp32 inputs (tf32 would lose ~3 digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded_dim(n: int, minimum: int = 16) -> int:
    """Next power of two >= n, at least `minimum` (tl.dot operands need every dim >= 16 on a GPU)."""
    return max(minimum, triton.next_power_of_2(n))


@triton.jit
def load_kv_tile(cache_ptr, block, offset, kv_head, dim, mask, s_b, s_o, s_h, s_d, UPCAST: tl.constexpr):
    """Gather a [BLOCK_N, BLOCK_D] tile of one KV head from per-token (block, offset) pairs."""
    ptrs = cache_ptr + block[:, None] * s_b + offset[:, None] * s_o + kv_head * s_h + dim[None, :] * s_d
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def online_softmax_step(q, k, v, keep, m, denom, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one key tile into the running (max, sum, acc) of base-2 online softmax; `keep` masks scores."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: p = 0
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc
