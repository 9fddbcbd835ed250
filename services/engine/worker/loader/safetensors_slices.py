"""SafetensorsSlices: read row or column slices of a safetensors file's tensors with plain reads, no mmap.

safetensors' own ``get_slice`` hands out views of one memory map of the whole file, so every page a
rank touches stays resident until the file is closed: a tensor-parallel rank would peak at its share of
the weights twice (its parameters plus the mapped pages). Reading each slice into its own buffer with
``readinto`` keeps the file in the kernel's page cache only, so a rank's peak is its share plus one
slice in flight.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_CHUNK_BYTES = 8 * 2**20  # rows read at a time for a column slice


class FileSlice:
    """One tensor of the file, read lazily: ``[a:b]`` (rows), ``[:, a:b]`` (columns) or ``[:]``."""

    def __init__(self, f: io.BufferedReader, offset: int, dtype: torch.dtype, shape: list[int]) -> None:
        self.f, self.offset, self.dtype, self.shape = f, offset, dtype, shape
        self.row_bytes = torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size()

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            return self._rows(*index.indices(self.shape[0])[:2])
        rows, cols = index
        if rows != slice(None) or not isinstance(cols, slice) or len(self.shape) != 2:
            raise IndexError(f"FileSlice reads [a:b] or [:, a:b] of a 2-D tensor, not {index!r}")
        start, stop = cols.indices(self.shape[1])[:2]
        out = torch.empty((self.shape[0], max(stop - start, 0)), dtype=self.dtype)
        per = max(1, _CHUNK_BYTES // max(self.row_bytes, 1))
        for first in range(0, self.shape[0], per):
            chunk = self._rows(first, min(first + per, self.shape[0]))
            out[first : first + chunk.shape[0]] = chunk[:, start:stop]
        return out

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        out = torch.empty((max(stop - start, 0), *self.shape[1:]), dtype=self.dtype)
        if out.numel():
            self.f.seek(self.offset + start * self.row_bytes)
            if self.f.readinto(out.view(torch.uint8).numpy().reshape(-1).data) != out.nbytes:
                raise ValueError(f"safetensors file {self.f.name} is truncated")
        return out


class SafetensorsSlices:
    """The tensors of one safetensors file by name (its header parsed once), each a FileSlice."""

    def __init__(self, path: Path) -> None:
        self.f = path.open("rb")
        (size,) = struct.unpack("<Q", self.f.read(8))
        header = json.loads(self.f.read(size))
        header.pop("__metadata__", None)
        self.base, self.header = 8 + size, header

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, name: str) -> FileSlice:
        entry = self.header[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {entry['dtype']}, which sliced loading does not read"
            )
        return FileSlice(
            self.f, self.base + entry["data_offsets"][0], _DTYPES[entry["dtype"]], entry["shape"]
        )

    def __enter__(self) -> SafetensorsSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()
