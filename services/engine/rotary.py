"""Rotary position embedding: cos/sin tables (default, linear, llama3 scaling) and the torch rotation."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for a rope_scaling config, computed exactly as HF transformers does."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, rope_scaling)
    raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported (supported: default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    factor, low, high = cfg["factor"], cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin(
    head_dim: int, max_pos: int, base: float, rope_scaling: dict[str, Any] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_pos, head_dim] in HF's rotate-half layout (frequencies repeated twice)."""
    inv_freq = inv_frequencies(head_dim, base, rope_scaling)
    t = torch.arange(max_pos, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token cos/sin [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
