"""ImageInputs: a request's images as the engine runs them (MMInputs), from the shared placeholder
expansion in services.common.image_inputs (the router hashes the same ids)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from services.common.hashing import MMSpan
from services.common.image_inputs import ImagePlaceholders
from services.engine.core.mm_input import MMInput


class ImageInputs:
    """Turns (prompt token ids, images) into (expanded token ids, MMInputs) for one vision model."""

    def __init__(self, model_dir: str | Path) -> None:
        placeholders = ImagePlaceholders.from_model_dir(model_dir)
        if placeholders is None:
            raise ValueError(f"{model_dir}: not a vision-language checkpoint (no vision_config)")
        self.placeholders = placeholders

    @property
    def token_id(self) -> int:
        return self.placeholders.token_id

    def expand(
        self, token_ids: list[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[MMInput, ...]]:
        ids, placed = self.placeholders.expand(token_ids, images)
        return ids, tuple(MMInput(p.start, p.length, p.content_hash, p.pixels) for p in placed)


def mm_spans(mm_inputs: Sequence[MMInput]) -> tuple[MMSpan, ...]:
    """The block-hash keys of a request's images."""
    return tuple(MMSpan(start=m.start, end=m.end, content_hash=m.content_hash) for m in mm_inputs)
