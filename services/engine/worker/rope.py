"""Rotary position embedding for the torch path: per-step cos/sin rows and the rotate-half rotation.

The cos/sin table itself is `kvkernels.reference.build_cos_sin_cache` (HF semantics, incl. linear and
llama3 scaling): one definition shared by the torch path and the Triton kernel.
"""

from __future__ import annotations

import torch


def rope_rows(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rot_dim] for the given positions, frequencies repeated (HF rotate-half layout)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token cos/sin [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
