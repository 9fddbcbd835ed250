"""PackedLinear: a model's nn.Linear with its weight reordered once by oneDNN for this CPU (chosen at load).

Measured here (2 cores, Xeon with AMX): bf16 packed beats ``F.linear`` at every batch size (1.1-2.4x);
fp32 packed loses below 8 rows (0.5-0.9x at 1 row) and wins from 8 (1.0-2.4x), so fp32 keeps the plain
weight for small batches. bf16 on AVX512-BF16 CPUs also keeps kvferry's pair tiles for the GEMV of a few
rows (kvkernels.cpu.bf16_gemv; ``python benchmarks/bf16_gemv.py`` gives the crossover), which reads the
weights faster than oneDNN's kernel when a step is bound by memory bandwidth.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvkernels.cpu import pack_bf16_gemv

log = logging.getLogger(__name__)

FP32_MIN_ROWS = 8  # fp32: oneDNN's packed kernel from this many rows, F.linear below
# bf16: kvferry's GEMV below this many rows (where built), oneDNN's packed kernel from it. Measured on Zen 4
# (2 cores, weights streamed from memory): the GEMV 1.4-1.8x at 1-4 rows, 1.2-1.4x at 8, 1.0-1.2x at 12,
# 0.8-1.1x at 16 (benchmarks/results/bf16_gemv.json).
BF16_GEMV_ROWS = 12
GEMV_CHOICE = "KVFERRY_BF16_GEMV"  # "auto" (default) or "off"


def onednn_available() -> bool:
    """oneDNN (mkldnn) is compiled into this torch and usable on this CPU."""
    return bool(torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` through ``torch.ops.mkldnn._linear_pointwise`` on a pre-packed ``W``.

    ``min_rows`` > 1 keeps the plain weight too and uses ``F.linear`` for inputs with fewer rows.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = 1, gemv: ModuleType | None = None) -> None:
        """``gemv``: the CPU kernels' module, to serve bf16 inputs of fewer than ``min_rows`` rows with
        kvferry's bf16 GEMV (instead of a plain weight and F.linear)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.min_rows = min_rows
        readable = weight.dtype == torch.bfloat16 and self.in_features % 2 == 0
        bf16_bias = self.bias is None or self.bias.dtype == torch.bfloat16
        self.gemv = gemv if gemv is not None and readable and bf16_bias else None
        # the compiled kernel is called directly: per-call wrapper overhead counts at batch 1
        self.tiles = pack_bf16_gemv(weight) if self.gemv is not None else None
        self.plain = weight if min_rows > 1 and self.gemv is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's [tokens, features]: no reshape or view (microseconds each)
        rows = x if flat else x.reshape(-1, self.in_features)
        if self.gemv is not None and rows.shape[0] < self.min_rows and rows.dtype == torch.bfloat16:
            out = torch.empty((rows.shape[0], self.out_features), dtype=torch.bfloat16)
            self.gemv.bf16_gemv(out, rows.contiguous(), self.tiles, self.bias)
        elif self.plain is not None and rows.shape[0] < self.min_rows:
            out = F.linear(rows, self.plain, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Resident bytes (the packed weight, the plain one where kept, the bias)."""
        tensors = (self.packed, self.plain, self.tiles, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        small = "kvferry bf16 GEMV" if self.gemv is not None else "F.linear"
        return f"in={self.in_features}, out={self.out_features}, min_rows={self.min_rows} ({small} below)"


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """Swap every nn.Linear of a loaded model for a PackedLinear where that pays; says what it did."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return "plain F.linear"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "plain F.linear (oneDNN has no bf16 path on this CPU: it needs AVX-512 or AVX-NE-CONVERT)"
    gemv = bf16_gemv_kernels() if dtype == torch.bfloat16 else None
    min_rows = FP32_MIN_ROWS if dtype == torch.float32 else BF16_GEMV_ROWS if gemv is not None else 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, min_rows, gemv))
                swapped += 1
    below = "kvferry's bf16 GEMV" if gemv is not None else "F.linear"
    how = "every batch" if min_rows == 1 else f"from {min_rows} rows ({below} below)"
    return f"oneDNN pre-packed weights on {swapped} linears, {how}"


def bf16_gemv_kernels(env: Mapping[str, str] = os.environ) -> ModuleType | None:
    """The CPU kernels' module where it has the bf16 GEMV (an AVX512-BF16 build), else None.

    ``KVFERRY_BF16_GEMV=off`` opts out: the GEMV keeps a second copy of each bf16 weight (its pair tiles
    beside oneDNN's packed one), which doubles the weights' resident bytes."""
    from kvkernels import cpu

    choice = env.get(GEMV_CHOICE, "auto")
    if choice not in ("auto", "off"):
        raise ValueError(f"{GEMV_CHOICE}={choice!r}: expected 'auto' (the default) or 'off'")
    if choice == "off":
        return None
    return cpu.load() if cpu.has_bf16_gemv() else None
