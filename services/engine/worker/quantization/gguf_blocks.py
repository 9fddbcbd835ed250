"""GGUF blocks read into GroupQuantWeight: Q4_0 / Q4_1 / Q4_K / Q8_0 exactly, the other int8-run types via floats."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight

# Kept as 4-bit codes (exact); the int8 types run as per-channel int8 (requantized from their blocks).
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
INT8_TYPES = frozenset({"Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
SUPPORTED_TYPES = INT4_TYPES | INT8_TYPES | FLOAT_TYPES


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble order: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> GroupQuantWeight:
    """Codes, scales and offsets of a Q4_0 / Q4_1 / Q4_K tensor of ``rows`` x ``cols`` values."""
    data = np.asarray(raw, dtype=np.uint8).reshape(rows, -1)
    if kind == "Q4_0":
        b = data.reshape(rows, cols // 32, 18)
        d = _f16(b[..., 0:2])
        codes, scale, offset = _nibbles(b[..., 2:]), d, -8.0 * d
    elif kind == "Q4_1":
        b = data.reshape(rows, cols // 32, 20)
        codes, scale, offset = _nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    elif kind == "Q4_K":
        codes, scale, offset = _q4_k(data.reshape(rows, cols // 256, 144))
    else:
        raise ValueError(f"{kind} is not a 4-bit GGUF block type")
    return GroupQuantWeight(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1), dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, -1), dtype=np.float32)),
        bits=4,
        group=32,
    )


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and mins."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc = b[..., 4:16].astype(np.int32)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
    lo_sc, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_sc = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    scales = np.concatenate([lo_sc, hi_sc], axis=-1).astype(np.float32)
    mins = np.concatenate([lo_m, hi_m], axis=-1).astype(np.float32)
    # chunk c (64 values) = sub-block 2c from the low nibbles, 2c+1 from the high ones
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 256)
    return codes, d[..., None] * scales, -dmin[..., None] * mins


def gguf_weight(kind: str, raw: np.ndarray, rows: int, cols: int) -> GroupQuantWeight:
    """A quantized GGUF matrix as codes: 4-bit types exactly, Q8_0 exactly (8-bit), others via floats."""
    if kind in INT4_TYPES:
        return q4_blocks(kind, raw, rows, cols)
    if kind == "Q8_0":
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // 32, 34)
        d = _f16(b[..., 0:2])
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return GroupQuantWeight(
            torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
            torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(-128.0 * d)),
            bits=8,
            group=32,
        )
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    w = np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(rows, cols)
    return GroupQuantWeight.quantize(torch.from_numpy(w), 8, 32 if cols % 32 == 0 else cols)
