"""Int4Linear / Int8Linear / Int8Embedding: weight-only quantized layers that keep the packed bytes resident.

Small batches read the packed bytes directly. int4 in bf16: kvferry's C++ GEMV on CPUs with AVX512_BF16
(1.7x torch's kernel on SmolLM2's layers at batch 1), else torch's ``_weight_int4pack_mm_for_cpu`` on the
same int4pack bytes. int8: kvferry's C++ int8 GEMV (torch's ``_weight_int8pack_mm`` without the C++
kernels: slower at batch 1 and crashing in bf16 when K is not a multiple of 16). From ``min_dense_rows``
rows kvferry's C++ kernel dequantizes a tile of output features at a time into a cache-sized buffer and
runs a dense GEMM on it, where per-row kernels lose (crossovers measured by benchmarks/quant.py). Without
the C++ kernels the dense path dequantizes the whole weight with torch ops (slow, but exact).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight
from services.engine.worker.quantization.int8_rows import Int8Rows

INT4_GROUPS = (256, 128, 64, 32)  # group sizes torch's int4pack kernel takes
_BLOCK_N = 64  # int4pack's CPU layout tiles output rows by 64: byte j of a tile holds rows j and j + 32
INT4_DENSE_ROWS = 16
INT8_DENSE_ROWS = 16


def pack_int4_tiles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N (a multiple of 64), K] as kvferry's kernels read them, on any CPU: tiles of 64
    output rows, byte j of (tile, k) holding row j in its low nibble and row j + 32 in its high one
    (torch's int4pack layout on AVX-512; on AVX2 torch packs 32-row tiles instead)."""
    n, k = codes.shape
    tiles = codes.to(torch.uint8).view(n // _BLOCK_N, 2, _BLOCK_N // 2, k)  # [tile, half, j, k]
    return (tiles[:, 0] | (tiles[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


@functools.cache
def torch_packs_int4_tiles() -> bool:
    """Whether torch's int4pack kernel on this CPU reads kvferry's tiles (it packs that way on AVX-512)."""
    codes = torch.arange(_BLOCK_N * 4, dtype=torch.int32).remainder(16).view(_BLOCK_N, 4)
    return torch.equal(torch._convert_weight_to_int4pack_for_cpu(codes, 1), pack_int4_tiles(codes))


class Int4Linear(nn.Module):
    """``y = x W^T + b``, W as 4-bit codes with a bf16/fp32 scale and zero per (row, group)."""

    def __init__(
        self,
        gw: GroupQuantWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        min_dense_rows: int = INT4_DENSE_ROWS,
    ) -> None:
        super().__init__()
        if gw.bits != 4:
            raise ValueError(f"Int4Linear needs 4-bit codes, got {gw.bits}-bit")
        group = next((g for g in INT4_GROUPS if gw.group % g == 0), None)
        if group is None:
            raise ValueError(f"4-bit group size {gw.group} is not a multiple of 32")
        gw = gw.regroup(group)
        self.out_features, self.in_features = gw.shape
        self.group, self.dtype, self.min_dense_rows = group, dtype, min_dense_rows
        self.ops = cpu_ops()
        # the compiled kernels, called directly (per-call wrapper overhead counts at batch 1), where kvferry's
        # int4 GEMV serves this layer's small batches; None: torch's int4pack kernel
        self.gemv = _extension() if dtype == torch.bfloat16 and has_int4_gemv(self.ops) else None
        pad = -self.out_features % _BLOCK_N
        codes = F.pad(gw.codes.to(torch.int32), (0, 0, 0, pad))
        # kvferry's kernels read the 64-row tiles; torch's kernel reads its own packing, which is that
        # layout only where torch runs AVX-512 (32-row tiles on AVX2 CPUs)
        self.native = self.ops is None  # no C++ kernels: torch's packing and kernel for every batch
        self.packed = (
            torch._convert_weight_to_int4pack_for_cpu(codes, 1) if self.native else pack_int4_tiles(codes)
        )
        self.torch_reads_tiles = self.native or torch_packs_int4_tiles()
        scales, offsets = (F.pad(t, (0, 0, 0, pad)) for t in (gw.scales, gw.offsets))
        # int4pack computes (q - 8) * scale + zero; ours is q * scale + offset
        self.scales_and_zeros = (
            torch.stack([scales, offsets + 8 * scales], dim=-1).transpose(0, 1).contiguous().to(dtype)
        )
        self.perm = gw.perm
        self.bias = None if bias is None else bias.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        small = rows.shape[0] < self.min_dense_rows
        if small and self.gemv is not None:
            out = torch.empty((rows.shape[0], self.packed.shape[0]), dtype=rows.dtype)
            self.gemv.woq_int4_gemv(out, rows.contiguous(), self.packed, self.scales_and_zeros, self.group)
        elif self.native or (small and self.torch_reads_tiles):
            out = torch._weight_int4pack_mm_for_cpu(
                rows.contiguous(), self.packed, self.group, self.scales_and_zeros
            )
        else:
            assert self.ops is not None
            out = self.ops.woq_int4_linear(rows, self.packed, self.scales_and_zeros, self.group)
        if out.shape[1] != self.out_features:  # int4pack pads the output rows to a multiple of 64
            out = out[:, : self.out_features].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return _nbytes(self.packed, self.scales_and_zeros, self.bias, self.perm)

    def extra_repr(self) -> str:
        gemv = "torch" if self.gemv is None else "kvferry"
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group}, gemv={gemv}, "
            f"dense_from={self.min_dense_rows}"
        )


class Int8Linear(nn.Module):
    """``y = (x W_q^T) * s + b`` with W_q int8 and one scale per output row (symmetric)."""

    def __init__(
        self,
        weight: torch.Tensor | Int8Rows,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        min_dense_rows: int = INT8_DENSE_ROWS,
    ) -> None:
        """``weight``: a float weight to quantize, or its codes (a tensor-parallel shard of them)."""
        super().__init__()
        rows = weight if isinstance(weight, Int8Rows) else Int8Rows.quantize(weight)
        self.out_features, self.in_features = rows.shape
        self.qweight = rows.codes.contiguous()
        self.scales = rows.scales.to(dtype)
        self.dtype, self.min_dense_rows = dtype, min_dense_rows
        self.bias = None if bias is None else bias.to(dtype)
        self.ops = cpu_ops()
        self.gemv = _extension() if self.ops is not None else None  # called directly, as Int4Linear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] < self.min_dense_rows and self.gemv is not None:
            out = torch.empty((rows.shape[0], self.out_features), dtype=rows.dtype)
            self.gemv.woq_int8_gemv(out, rows.contiguous(), self.qweight, self.scales)
        else:
            out = int8_matmul(rows, self.qweight, self.scales, self.ops, self.min_dense_rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dense_from={self.min_dense_rows}"


class Int8Embedding(nn.Module):
    """A token embedding that reads the rows of a tied Int8Linear output projection (one copy of the bytes)."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule (its bytes are counted once, under lm_head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        return head.qweight[ids].to(head.dtype) * head.scales[ids].unsqueeze(-1)

    def weight_bytes(self) -> int:
        return 0


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``weight [..., N, K]`` with one fp32 scale per row [..., N] (absmax / 127)."""
    rows = Int8Rows.quantize(weight)
    return rows.codes, rows.scales


def int8_matmul(
    rows: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    ops: ModuleType | None,
    min_dense_rows: int = INT8_DENSE_ROWS,
) -> torch.Tensor:
    """rows [M, K] @ (qweight [N, K] * scales [N, 1])^T; scales in rows' dtype. kvferry's C++ GEMV for
    few rows, its tiled-dequant GEMM for more, torch's int8pack kernel or a dequantized copy without them."""
    few = rows.shape[0] < min_dense_rows
    if ops is not None:
        gemm = ops.woq_int8_gemv if few else ops.woq_int8_linear
        return gemm(rows, qweight, scales)
    if few and rows.shape[1] % 16 == 0:  # torch's kernel crashes (bf16) on other K
        return torch._weight_int8pack_mm(rows.contiguous(), qweight, scales)
    return F.linear(rows, qweight.to(rows.dtype)) * scales


def cpu_ops() -> ModuleType | None:
    """kvferry's C++ CPU kernels (``kvkernels.cpu``) where they built, looked up once per layer at load."""
    from kvkernels import cpu

    return cpu if cpu.available() else None


def has_int4_gemv(ops: ModuleType | None) -> bool:
    """Whether kvferry's int4 GEMV is there (``ops``: ``kvkernels.cpu`` or None; needs AVX512_BF16)."""
    return ops is not None and bool(ops.has_bf16_int4_gemv())


def _extension() -> ModuleType | None:
    from kvkernels import cpu

    return cpu.load()


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
