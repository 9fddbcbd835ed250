"""C++ CPU kernels (paged attention, KV cache writes, RMSNorm, rotary, SiLU-and-mul, weight-only linears)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

__all__ = [
    "available",
    "apply_token_bitmask",
    "bf16_gemv",
    "fused_add_rms_norm",
    "greedy_argmax",
    "has_bf16_gemv",
    "has_bf16_int4_gemv",
    "load",
    "pack_bf16_gemv",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "unavailable_reason",
    "woq_int4_gemv",
    "woq_int4_linear",
    "woq_int8_gemv",
    "woq_int8_linear",
]


def load() -> ModuleType | None:
    """The compiled extension (built on first call, then cached per process), or None; never raises."""
    from kvkernels.cpu.build import load_extension  # here, so `python -m kvkernels.cpu.build` imports it once

    return load_extension().module


def unavailable_reason() -> str | None:
    """Why load() returns None (no compiler, build error, ...), or None when the kernels are there."""
    from kvkernels.cpu.build import load_extension

    return load_extension().reason


def available() -> bool:
    """Whether the kernels can be used on this machine (builds them if needed)."""
    return load() is not None


def _ops() -> ModuleType:
    ops = load()
    if ops is None:
        raise RuntimeError(f"kvferry CPU kernels unavailable: {unavailable_reason()}")
    return ops


# torch's sum kernel is not dispatched to AVX-512: its cascade sum always runs on 8 fp32 lanes (the
# AVX2 and the 32-byte DEFAULT vectors), which fixes the order RMSNorm's mean must add in.
_SUM_LANES = 8


@functools.cache
def _torch_lanes() -> int:
    """fp32 lanes of torch's elementwise CPU kernels (where SiLU's vector/scalar split falls)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split_tokens: int = 0,
    window: int = 0,
    cascade: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch into out [T, Hq, D]; sequence b owns query rows
    query_start_loc[b]:query_start_loc[b+1], its last positions of seq_lens[b]. Caches are
    [num_blocks, block_size, Hkv, D] (strided layer views are fine). split_tokens > 0 forces decode
    rows into kv splits of that many positions (else chosen from the thread count). window > 0: a
    query at position p attends only to positions (p - window, p] (sliding-window attention).
    cascade: decode rows whose tables share a prefix attend it together (False: each row alone); None
    (the default): only for bf16 caches where the AMX decode kernel runs. Without AMX the dot products
    per (row, key) cost the same either way, and on a Zen 4 (AVX512-BF16) the cascade items were 7%
    slower in the engine (12-layer h768 model, 64 rows over a 512-token shared prefix).
    sinks: [Hq] attention-sink logits (gpt-oss): each head's softmax runs over its scores and its sink,
    whose column is then dropped (the sink only adds exp(sink) to the denominator)."""
    ops = _ops()
    if cascade is None:
        cascade = key_cache.dtype == torch.bfloat16 and bool(ops.has_amx_decode)
    ops.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        float(scale),
        int(split_tokens),
        int(window),
        bool(cascade),
        *(() if sinks is None else (sinks.float().contiguous(),)),  # a prebuilt without sinks still serves
    )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into cache slot slot_mapping[t] (block * block_size + offset); skip < 0."""
    _ops().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm over the last dim (fp32 normalize, cast to x.dtype, times weight): bit-exact."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _ops().rms_norm(out, x2, weight, float(eps), _SUM_LANES)
    return out if x2 is x else out.view(x.shape)  # a view costs microseconds: a decode step makes hundreds


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype first as the reference does."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype)
    new_residual = torch.empty(x2.shape, dtype=x.dtype)
    _ops().rms_norm(out, x2, weight, float(eps), _SUM_LANES, r2, new_residual)
    if x2 is x:
        return out, new_residual
    return out.view(x.shape), new_residual.view(x.shape)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE in place on query [T, Hq, D] and key [T, Hkv, D] (strided views fine); returns them."""
    _ops().rotary_embedding(positions, query, key, cos_sin_cache, bool(is_neox))
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] in fp32, cast to x.dtype: x [T, 2I] -> [T, I]."""
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], x2.shape[1] // 2), dtype=x.dtype)
    _ops().silu_and_mul(out, x2, _torch_lanes())
    return out if x2 is x else out.view(*x.shape[:-1], x.shape[-1] // 2)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: per row of logits [B, V] (any float dtype), the first index of its maximum, NaN counting
    as the maximum: torch.max(logits.float(), dim=-1).indices without converting the logits."""
    return _ops().greedy_argmax(_rows(logits))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, mask_rows: torch.Tensor
) -> None:
    """In place: logits[rows[i]] keeps the tokens set in bitmask[mask_rows[i]] (int32 words); others -inf."""
    _ops().apply_token_bitmask(logits, bitmask, rows, mask_rows)


WOQ_TILE_ROWS = (
    512  # output features per dequantized tile (measured: 128 pays per-GEMM overhead, 1024 spills L2)
)


def woq_int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] @ W^T for W in torch's int4pack CPU layout, dequantized one tile at a time: [M, Npad]."""
    out = torch.empty((x.shape[0], packed.shape[0]), dtype=x.dtype)
    _ops().woq_int4_linear(out, x.contiguous(), packed, scales_and_zeros, int(group), WOQ_TILE_ROWS)
    return out


def woq_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (qweight * scales[:, None])^T for int8 [N, K] rows, dequantized one tile at a time."""
    out = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype)
    _ops().woq_int8_linear(out, x.contiguous(), qweight, scales, WOQ_TILE_ROWS)
    return out


def woq_int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product for a few rows of x: one pass over the int8 bytes per 4 rows (no dequantized copy)."""
    out = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype)
    _ops().woq_int8_gemv(out, x.contiguous(), qweight, scales)
    return out


def has_bf16_int4_gemv() -> bool:
    """Whether the kernels have ``woq_int4_gemv`` (built for a CPU with AVX512_BF16)."""
    ops = load()
    return bool(ops is not None and ops.has_bf16_int4_gemv)


def woq_int4_gemv(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """Few bf16 rows x [M, K] @ W^T for W in torch's int4pack CPU layout, reading the 4-bit codes once per 4
    rows (bf16 dot products of the exact codes): [M, Npad]."""
    out = torch.empty((x.shape[0], packed.shape[0]), dtype=x.dtype)
    _ops().woq_int4_gemv(out, x.contiguous(), packed, scales_and_zeros, int(group))
    return out


GEMV_TILE = 64  # output features per pair tile of bf16_gemv


def has_bf16_gemv() -> bool:
    """Whether the kernels have ``bf16_gemv`` (built for a CPU with AVX512_BF16)."""
    ops = load()
    return bool(ops is not None and ops.has_bf16_gemv)


def pack_bf16_gemv(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (K even) as bf16_gemv's pair tiles [ceil(N / 64), K / 2, 64, 2], zero-padded."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16_gemv needs an even number of input features, not {k}")
    padded = torch.nn.functional.pad(weight.to(torch.bfloat16), (0, 0, 0, -n % GEMV_TILE))
    return padded.view(-1, GEMV_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_gemv(x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Few bf16 rows x [M, K] @ W^T (+ bias) for W packed by pack_bf16_gemv, N = n output features: [M, n]."""
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    _ops().bf16_gemv(out, x.contiguous(), tiles, bias)
    return out
