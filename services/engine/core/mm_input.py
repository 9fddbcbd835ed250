"""MMInput: one image of a request, as the scheduler and the runner see it (no tensors are touched here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MMInput:
    """The prompt positions [start, start + length) hold this image's (or video's) features; ``data`` is its
    preprocessed pixels (opaque here) and ``content_hash`` their hash (encoder cache and block keys).
    ``is_embed`` marks the positions features fill, in order (None: all; the others are text tokens)."""

    start: int
    length: int
    content_hash: str
    data: Any
    is_embed: tuple[bool, ...] | None = None

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    @property
    def end(self) -> int:
        return self.start + self.length
