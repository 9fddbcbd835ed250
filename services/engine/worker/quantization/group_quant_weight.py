"""GroupQuantWeight: an [N, K] weight as 8-bit-or-less codes with a scale and an offset per (row, group)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class GroupQuantWeight:
    """``w[n, k] = value(codes[n, k]) * scales[n, k // group] + offsets[n, k // group]``.

    A code is an unsigned integer (``fmt="int"``) or the byte of an FP8 E4M3 number (``fmt="e4m3"``,
    offsets 0). The one form every reader (GGUF blocks, GPTQ, AWQ, FP8, quantize-at-load) produces and
    every linear method consumes. ``perm`` (act-order checkpoints) is the input-column order the codes
    are stored in: the layer computes ``x[:, perm] @ w.T``.
    """

    codes: torch.Tensor  # uint8 [N, K], 0 .. 2**bits - 1 (or FP8 bytes)
    scales: torch.Tensor  # float32 [N, K // group]
    offsets: torch.Tensor  # float32 [N, K // group]
    bits: int
    group: int
    perm: torch.Tensor | None = None  # int64 [K]
    fmt: str = "int"  # "int" | "e4m3"

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if (
            k % self.group
            or self.scales.shape != (n, k // self.group)
            or self.offsets.shape != self.scales.shape
        ):
            raise ValueError(
                f"quantized weight: codes {tuple(self.codes.shape)}, group {self.group}, "
                f"scales {tuple(self.scales.shape)}, offsets {tuple(self.offsets.shape)} do not agree"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and offsets repeated over their group: two [N, K] float32 tensors."""
        return (
            self.scales.repeat_interleave(self.group, dim=1),
            self.offsets.repeat_interleave(self.group, dim=1),
        )

    def code_values(self) -> torch.Tensor:
        """The codes as float32 numbers (the integers, or the FP8 values their bytes encode)."""
        if self.fmt == "e4m3":
            return self.codes.view(torch.float8_e4m3fn).float()
        return self.codes.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight in the checkpoint's input-column order (``perm`` undone)."""
        scale, offset = self.expanded()
        w = self.code_values() * scale + offset
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def regroup(self, group: int) -> GroupQuantWeight:
        """The same weight with ``group`` columns per scale (``group`` divides this one's group)."""
        if group == self.group:
            return self
        if self.group % group:
            raise ValueError(f"cannot regroup a group of {self.group} into groups of {group}")
        rep = self.group // group
        return replace(
            self,
            scales=self.scales.repeat_interleave(rep, dim=1),
            offsets=self.offsets.repeat_interleave(rep, dim=1),
            group=group,
        )

    def __getitem__(self, key: slice | tuple[slice, slice]) -> GroupQuantWeight:
        """Rows ``w[a:b]`` or input columns ``w[:, a:b]`` (a tensor-parallel shard). A column range must
        cover whole groups, or lie in a row's one group; act-order weights cannot be cut by columns."""
        if not isinstance(key, tuple):
            return replace(self, codes=self.codes[key], scales=self.scales[key], offsets=self.offsets[key])
        a, b, _ = key[1].indices(self.shape[1])
        if self.perm is not None:
            raise ValueError(
                "act-order (desc_act) weights store their input columns permuted: they cannot be split by "
                "input columns (tensor parallelism over a row-parallel layer)"
            )
        codes = self.codes[:, a:b]
        if self.group == self.shape[1]:  # one scale per row holds for any column range
            return replace(self, codes=codes, group=b - a)
        if a % self.group or b % self.group:
            raise ValueError(
                f"quantized weight: input columns {a}:{b} split its groups of {self.group} (tensor "
                "parallelism needs each rank's columns to be whole groups)"
            )
        g = slice(a // self.group, b // self.group)
        return replace(self, codes=codes, scales=self.scales[:, g], offsets=self.offsets[:, g])

    def pad_rows(self, rows: int) -> GroupQuantWeight:
        """Zero rows appended up to ``rows`` (a vocabulary shard's padding: they dequantize to 0)."""
        extra = rows - self.shape[0]

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])

        return replace(self, codes=pad(self.codes), scales=pad(self.scales), offsets=pad(self.offsets))

    def select_rows(self, index: torch.Tensor) -> GroupQuantWeight:
        return replace(self, codes=self.codes[index], scales=self.scales[index], offsets=self.offsets[index])

    def same_layout(self, other: GroupQuantWeight) -> bool:
        """Whether the two can be stacked into one fused layer (same bits, group, format and order)."""
        same_perm = self.perm is other.perm or (
            self.perm is not None and other.perm is not None and torch.equal(self.perm, other.perm)
        )
        return self.bits == other.bits and self.group == other.group and self.fmt == other.fmt and same_perm

    @staticmethod
    def cat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
        """Stack the row blocks of a fused layer (q|k|v, gate|up); they must share one layout."""
        first = parts[0]
        if not all(first.same_layout(p) for p in parts[1:]):
            raise ValueError("fused shards differ in bits, group size, format or act-order; cannot fuse")
        return replace(
            first,
            codes=torch.cat([p.codes for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            offsets=torch.cat([p.offsets for p in parts]),
        )

    @classmethod
    def quantize(cls, w: torch.Tensor, bits: int, group: int) -> GroupQuantWeight:
        """Asymmetric min/max quantization of a float [N, K] weight, ``group`` columns per scale."""
        n, k = w.shape
        if k % group:
            raise ValueError(f"group size {group} does not divide the input size {k}")
        g = w.float().reshape(n, k // group, group)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        levels = 2**bits - 1
        scale = ((hi - lo) / levels).clamp_min(1e-12)
        codes = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, levels)
        return cls(codes.reshape(n, k).to(torch.uint8), scale, lo, bits, group)

    @classmethod
    def quantize_fp8(cls, w: torch.Tensor) -> GroupQuantWeight:
        """FP8 E4M3 codes with one scale per output row (the row's amax maps to 448)."""
        n, k = w.shape
        scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-12)
        codes = (w.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return cls(codes, scale, torch.zeros_like(scale), 8, k, fmt="e4m3")
