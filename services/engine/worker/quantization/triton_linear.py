"""TritonQuantLinear: a quantized layer run by kvkernels.dequant_matmul (GPUs; Triton's interpreter on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight


class TritonQuantLinear(nn.Module):
    """``y = x W^T + b`` with W as 4- or 8-bit codes and a scale and offset per (row, group), read in the GEMM.

    Unlike the CPU layers, 8-bit group-wise codes (GPTQ 8-bit, GGUF Q8_0) stay exactly as stored.
    """

    def __init__(self, gw: GroupQuantWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        from kvkernels.dequant_matmul import pack_int4

        if gw.group % 16:
            raise ValueError(f"quantized layer: group size {gw.group} is not a multiple of 16")
        self.out_features, self.in_features = gw.shape
        self.bits, self.group, self.dtype = gw.bits, gw.group, dtype
        self.qweight = pack_int4(gw.codes) if gw.bits == 4 else gw.codes.to(torch.uint8).contiguous()
        side = torch.float32 if dtype == torch.float32 else torch.float16  # GGUF / GPTQ store fp16 scales
        self.scales, self.offsets = gw.scales.to(side).contiguous(), gw.offsets.to(side).contiguous()
        self.perm, self.fp8 = gw.perm, gw.fmt == "e4m3"
        self.bias = None if bias is None else bias.to(dtype)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """Move the plain tensor attributes with the module (``.to(device)``)."""
        for name in ("qweight", "scales", "offsets", "perm", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kvkernels.dequant_matmul import dequant_matmul

        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        out = dequant_matmul(
            rows, self.qweight, self.scales, self.offsets, self.bits, self.group, self.bias, fp8=self.fp8
        )
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        tensors = (self.qweight, self.scales, self.offsets, self.perm, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group}"
