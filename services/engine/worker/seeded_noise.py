"""seeded_exponential: Exp(1) noise that depends only on (key, token), the same on every device.

A seeded request's draw at a position is a pure function of (seed, position): a counter-based hash of
(key, token index) turned into a uniform and then an exponential, computed as one batch on the logits'
device. So a seeded row needs no per-request generator (no Python loop, no CPU generator next to GPU
logits), and any engine, on any device, continues the same stream. Integer arithmetic is done in int64
on values below 2**32 with multipliers below 2**31, so nothing overflows on any backend.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)  # odd multipliers below 2**31 (products stay in int64)
_GOLDEN = 0x9E3779B1  # spreads consecutive token indices (times a token index below 2**31: no overflow)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32)."""
    for m in _MIX:
        x = x ^ (x >> 16)
        x = (x * m) & _MASK32
    return x ^ (x >> 15)


def row_hashes(keys: torch.Tensor) -> torch.Tensor:
    """One 32-bit hash per int64 key (both halves of the key count)."""
    lo, hi = keys & _MASK32, (keys >> 32) & _MASK32
    return _mix32(lo ^ _mix32(hi ^ 0x5BD1E995))


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 Exp(1) noise [R, vocab] on ``keys``' device: row r depends only on ``keys[r]``."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    x = _mix32((row_hashes(keys)[:, None] + tokens[None, :] * _GOLDEN) & _MASK32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1): never log(0)
    return -torch.log(u)
