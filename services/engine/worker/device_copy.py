"""to_device: host tensors onto the device of the data they meet: one non-blocking copy from pinned memory."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a fresh CPU tensor) on ``device``: itself on the CPU, else one non-blocking copy from
    pinned memory (the pinned buffer lives until the copy is done: the caching host allocator keeps it)."""
    if device.type == "cpu":
        return host
    if torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
