"""MMInput: one image of a request, as the scheduler and the runner see it (no tensors are touched here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MMInput:
    """The prompt positions [start, start + length) hold this image's features; ``data`` is its
    preprocessed pixels (opaque here) and ``content_hash`` their hash (encoder cache and block keys)."""

    start: int
    length: int
    content_hash: str
    data: Any

    @property
    def end(self) -> int:
        return self.start + self.length
