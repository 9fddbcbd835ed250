"""PackedLinear: a model's nn.Linear with its weight reordered once by oneDNN for this CPU (chosen at load).

Measured here (2 cores, Xeon with AMX; benchmarks/linear_kernels.py):
bf16 packed beats ``F.linear`` at every batch size (1.1-2.4x); fp32 packed loses below 8 rows
(0.5-0.9x at 1 row) and wins from 8 (1.0-2.4x), so fp32 keeps the plain weight for small batches.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FP32_MIN_ROWS = 8  # fp32: oneDNN's packed kernel from this many rows, F.linear below


def onednn_available() -> bool:
    """oneDNN (mkldnn) is compiled into this torch and usable on this CPU."""
    return bool(torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` through ``torch.ops.mkldnn._linear_pointwise`` on a pre-packed ``W``.

    ``min_rows`` > 1 keeps the plain weight too and uses ``F.linear`` for inputs with fewer rows.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.min_rows = min_rows
        self.plain = weight if min_rows > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's [tokens, features]: no reshape or view (microseconds each)
        rows = x if flat else x.reshape(-1, self.in_features)
        if self.plain is not None and rows.shape[0] < self.min_rows:
            out = F.linear(rows, self.plain, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Resident bytes (the packed weight, the plain one where kept, the bias)."""
        tensors = (self.packed, self.plain, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, min_rows={self.min_rows}"


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """Swap every nn.Linear of a loaded model for a PackedLinear where that pays; says what it did."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return "plain F.linear"
    min_rows = FP32_MIN_ROWS if dtype == torch.float32 else 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, min_rows))
                swapped += 1
    how = "every batch" if min_rows == 1 else f"from {min_rows} rows (F.linear below)"
    return f"oneDNN pre-packed weights on {swapped} linears, {how}"
