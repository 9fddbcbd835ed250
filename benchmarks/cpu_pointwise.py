"""The pointwise rows of benchmarks/cpu_kernels.py: RMSNorm, rotary, SiLU-and-mul, cache write vs torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import kvkernels.cpu as kc
from benchmarks.timing import median_ms
from kvkernels.reference import build_cos_sin_cache


def pointwise_rows(dtype: torch.dtype, tokens: int, block: int = 16) -> list[dict]:
    """RMSNorm (plain and fused add), rotary, SiLU-and-mul and the cache write vs their torch versions."""
    hidden, inter, hq, hkv, d = 768, 2048, 12, 12, 64
    dt = str(dtype).removeprefix("torch.")
    rows = []

    def row(name: str, torch_fn: Callable, kernel_fn: Callable) -> None:
        t_ms, k_ms = median_ms([torch_fn, kernel_fn])
        rows.append(
            {
                "kind": "pointwise",
                "op": name,
                "dtype": dt,
                "tokens": tokens,
                "torch_ms": t_ms,
                "kernel_ms": k_ms,
                "speedup": t_ms / k_ms,
            }
        )

    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)

    def torch_norm(x: torch.Tensor, r: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if r is not None:
            x = x + r
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(x.dtype), x

    row("rms_norm", lambda: torch_norm(x), lambda: kc.rms_norm(x, w, 1e-5))
    row("fused_add_rms_norm", lambda: torch_norm(x, res), lambda: kc.fused_add_rms_norm(x, res, w, 1e-5))

    qkv = torch.randn(tokens, hq + 2 * hkv, d, dtype=dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    cache = build_cos_sin_cache(d, 8192, 10000.0, None, dtype)
    pos = torch.randint(0, 8192, (tokens,))

    def torch_rope() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cache.index_select(0, pos).chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

        def rot(t: torch.Tensor) -> torch.Tensor:
            rotated = torch.cat((-t[..., d // 2 :], t[..., : d // 2]), dim=-1)
            return t * cos + rotated * sin

        return rot(q), rot(k)

    row("rotary", torch_rope, lambda: kc.rotary_embedding(pos, q, k, cache, True))

    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)

    def torch_silu() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    row("silu_and_mul", torch_silu, lambda: kc.silu_and_mul(gate_up))

    blocks = -(-tokens // block) + 8
    kv = torch.zeros(blocks, 3, 2, block, hkv, d, dtype=dtype)
    key, value = torch.randn(tokens, hkv, d, dtype=dtype), torch.randn(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(blocks * block)[:tokens]

    def torch_write() -> None:
        token_rows = kv.view(-1, hkv * d)
        b, o = slots // block, slots % block
        r = ((b * 3 + 1) * 2) * block + o
        token_rows.index_copy_(0, r, key.reshape(-1, hkv * d))
        token_rows.index_copy_(0, r + block, value.reshape(-1, hkv * d))

    row(
        "reshape_and_cache",
        torch_write,
        lambda: kc.reshape_and_cache(key, value, kv[:, 1, 0], kv[:, 1, 1], slots),
    )
    return rows
