"""MXFP4 (OCP microscaling FP4) blocks as gpt-oss checkpoints store their experts: decode to floats.

A row of K values is K / 32 blocks; a block is 16 bytes of E2M1 codes (two per byte, the low nibble first)
and one uint8 scale, an E8M0 exponent biased by 127: value = FP4[code] * 2^(scale - 127).
"""

from __future__ import annotations

import torch

# E2M1 code -> value (bit 3 the sign, then a 2-bit exponent and a 1-bit mantissa)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in ``dtype`` (exact: every
    value is a small binary fraction times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (want [..., G, 16] / [..., G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = torch.ldexp(lut[codes.long()], (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest MXFP4 (blocks, scales) of weight [..., K] (K a multiple of 32): per block the scale that
    puts its largest magnitude at or under 6, each value rounded to the nearest code (tests, tools)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} values, not {weight.shape[-1]}")
    w = weight.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = w.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = torch.ldexp(w, -exp.unsqueeze(-1))
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8)
