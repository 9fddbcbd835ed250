"""ImageInputs: a request's images preprocessed, hashed, and their placeholder token expanded in the prompt
to as many tokens as the encoder gives features (so the scheduler and the hashes see the real length)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from services.common.hashing import MMSpan
from services.engine.core.mm_input import MMInput
from services.engine.worker.model_config import VisionTower
from services.engine.worker.multimodal.image_processor import ImageProcessor


def content_hash(pixels: np.ndarray) -> str:
    """The image's identity: its preprocessed pixels (not its URL or file bytes)."""
    h = hashlib.sha256(str(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


class ImageInputs:
    """Turns (prompt token ids, images) into (expanded token ids, MMInputs) for one vision model."""

    def __init__(self, model_dir: str | Path, vision: VisionTower) -> None:
        self.vision = vision
        self.processor = ImageProcessor.from_folder(model_dir, vision.image_size)

    def expand(
        self, token_ids: list[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[MMInput, ...]]:
        marker, n = self.vision.image_token_index, self.vision.tokens_per_image
        found = sum(1 for t in token_ids if t == marker)
        if found != len(images):
            raise ValueError(
                f"images: the prompt has {found} image placeholder(s) (token id {marker}) for {len(images)} image(s)"
            )
        out: list[int] = []
        mms: list[MMInput] = []
        pending = iter(images)
        for t in token_ids:
            if t != marker:
                out.append(t)
                continue
            pixels = self.processor(next(pending))
            mms.append(MMInput(len(out), n, content_hash(pixels), pixels))
            out.extend([marker] * n)
        return out, tuple(mms)


def mm_spans(mm_inputs: Sequence[MMInput]) -> tuple[MMSpan, ...]:
    """The block-hash keys of a request's images."""
    return tuple(MMSpan(start=m.start, end=m.end, content_hash=m.content_hash) for m in mm_inputs)
