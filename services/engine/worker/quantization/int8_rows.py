"""Int8Rows: symmetric int8 codes with one scale per output row, cut into tensor-parallel shards before use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROWS_AT_ONCE = 1024  # rows quantized per float temporary


@dataclass(frozen=True)
class Int8Rows:
    """``w[n, k] = codes[n, k] * scales[n]``: a whole weight quantized per row, so that every rank's shard
    holds the same codes and scales as the unsharded layer (a row-parallel shard keeps its rows' scales)."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]

    @classmethod
    def quantize(cls, weight: torch.Tensor, absmax: torch.Tensor | None = None) -> Int8Rows:
        """Symmetric int8 codes of a float [..., N, K] weight, one scale per row (absmax / 127; ``absmax``:
        the rows' own unless given, e.g. the whole rows' of a shard)."""
        w = weight.float()
        amax = cls.row_absmax(w) if absmax is None else absmax
        scale = (amax / 127).clamp_min(1e-12)
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        flat_w, flat_c, flat_s = w.reshape(-1, w.shape[-1]), codes.view(-1, w.shape[-1]), scale.reshape(-1, 1)
        for a in range(0, flat_w.shape[0], _ROWS_AT_ONCE):  # a float copy of a few rows at a time, not of w
            rows = flat_w[a : a + _ROWS_AT_ONCE] / flat_s[a : a + _ROWS_AT_ONCE]
            flat_c[a : a + _ROWS_AT_ONCE] = rows.round_().clamp_(-127, 127)
        return cls(codes, scale)

    @staticmethod
    def row_absmax(w: torch.Tensor) -> torch.Tensor:
        """Each row's largest absolute value, without an absolute copy of ``w``."""
        return torch.maximum(w.amax(dim=-1), w.amin(dim=-1).neg()).float()

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def __getitem__(self, key: slice | tuple[slice, slice]) -> Int8Rows:
        """Rows ``w[a:b]`` or input columns ``w[:, a:b]`` (the rows' scales stay whole)."""
        if isinstance(key, tuple):
            return Int8Rows(self.codes[key], self.scales)
        return Int8Rows(self.codes[key], self.scales[key])

    def pad_rows(self, rows: int) -> Int8Rows:
        """Zero rows appended up to ``rows`` (a vocabulary shard's padding)."""
        extra = rows - self.shape[0]
        return Int8Rows(
            torch.cat([self.codes, self.codes.new_zeros((extra, self.shape[1]))]),
            torch.cat([self.scales, self.scales.new_ones(extra)]),
        )

    @staticmethod
    def cat_rows(parts: list[Int8Rows]) -> Int8Rows:
        """The row blocks of a fused layer stacked (q|k|v, gate|up)."""
        return Int8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))
