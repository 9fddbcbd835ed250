"""ImagePlaceholders: a vision-language model's image placeholder, expanded in token ids to one token per
image feature, with each image's content hash (of its preprocessed pixels); and loading an image from
a request's URL. Router and engine both use it, so the ids they hash are the same."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from services.common.kv.hashing import MMSpan
from services.common.media.image_processor import ImageProcessor
from services.common.media.video_inputs import VideoSampling

MAX_IMAGE_BYTES = 20 * 2**20  # an encoded image larger than this is refused
MAX_IMAGE_PIXELS = 40_000_000  # a larger image (8K is 33 MP) is refused before it is decoded
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class PlacedImage:
    """One image (or video) in the expanded ids: positions [start, start + length), its hash and pixels
    ([C, H, W], or [tiles or frames, C, H, W]); ``is_embed`` marks the positions its features fill (None: all;
    the others keep their token's embedding: a family's tile separators)."""

    start: int
    length: int
    content_hash: str
    pixels: np.ndarray
    is_embed: tuple[bool, ...] | None = None

    def span(self) -> MMSpan:
        return MMSpan(start=self.start, end=self.start + self.length, content_hash=self.content_hash)


def content_hash(pixels: np.ndarray) -> str:
    """The image's identity: its preprocessed pixels (not its URL or file bytes)."""
    h = hashlib.sha256(str(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


class ImagePlaceholders:
    """The placeholder token, the features per image and the preprocessing of one model."""

    video_token_id: int | None = None  # LLaVA takes images only
    video_sampling: VideoSampling | None = None

    def __init__(self, token_id: int, tokens_per_image: int, processor: ImageProcessor) -> None:
        self.token_id, self.tokens_per_image, self.processor = token_id, tokens_per_image, processor

    @property
    def max_item_embeds(self) -> int:
        """Features of the largest image (all images have the same count)."""
        return self.tokens_per_image

    @staticmethod
    def serves(cfg: dict[str, Any]) -> bool:
        """A LLaVA-style config.json: a vision tower beside a text model."""
        return bool(cfg.get("vision_config")) and "text_config" in cfg

    @classmethod
    def from_model_dir(cls, folder: str | Path, cfg: dict[str, Any]) -> ImagePlaceholders:
        """From a LLaVA-style checkpoint's config.json (``cfg``) and its preprocessor config."""
        vision = cfg["vision_config"]
        patches = (vision["image_size"] // vision["patch_size"]) ** 2
        full = cfg.get("vision_feature_select_strategy", "default") == "full"
        token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
        return cls(token, patches + full, ImageProcessor.from_folder(folder, vision["image_size"]))

    def expand(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[PlacedImage]]:
        """Each placeholder -> ``tokens_per_image`` copies; ValueError when they do not match the images.

        Ids already expanded (every run of placeholders a multiple of ``tokens_per_image`` long, as the
        router sends them) are kept as they are, the images placed in the runs in order."""
        if any(not isinstance(image, Image.Image) for image in images):
            raise ValueError("videos: this model takes images only")
        found = sum(1 for t in token_ids if t == self.token_id)
        if (
            found == len(images) * self.tokens_per_image
            and found != len(images)
            and self._runs_fit(token_ids)
        ):
            return list(token_ids), self._place(token_ids, images)
        if found != len(images):
            raise ValueError(
                f"images: the prompt has {found} image placeholder(s) (token id {self.token_id}) for "
                f"{len(images)} image(s)"
            )
        out: list[int] = []
        placed: list[PlacedImage] = []
        pending = iter(images)
        for t in token_ids:
            if t != self.token_id:
                out.append(t)
                continue
            pixels = self.processor(next(pending))
            placed.append(PlacedImage(len(out), self.tokens_per_image, content_hash(pixels), pixels))
            out.extend([t] * self.tokens_per_image)
        return out, placed

    def _runs_fit(self, token_ids: Sequence[int]) -> bool:
        run = 0
        for t in [*token_ids, None]:
            if t == self.token_id:
                run += 1
            elif run:
                if run % self.tokens_per_image:
                    return False
                run = 0
        return True

    def _place(self, token_ids: Sequence[int], images: Sequence[Image.Image]) -> list[PlacedImage]:
        starts = [i for i, t in enumerate(token_ids) if t == self.token_id][:: self.tokens_per_image]
        out = []
        for start, image in zip(starts, images, strict=True):
            pixels = self.processor(image)
            out.append(PlacedImage(start, self.tokens_per_image, content_hash(pixels), pixels))
        return out


def load_image(url: str, local_root: Path | None = None) -> Image.Image:
    """A ``data:image/...;base64,`` URL, or ``file://`` under ``local_root``; ValueError saying why not."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError("image_url: a data URL must be data:image/<type>;base64,<data>")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"image_url: the image is over {MAX_IMAGE_BYTES // 2**20} MiB")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("image_url: the data URL is not valid base64") from exc
    elif url.startswith("file://"):
        data = _local_file(url.removeprefix("file://"), local_root)
    elif url.startswith(("http://", "https://")):
        raise ValueError("image_url: fetching http(s) URLs is disabled on this server; send a data: URL")
    else:
        raise ValueError("image_url: the URL must be a data: URL (or file:// where allowed)")
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in FORMATS:
            raise ValueError(f"image_url: {image.format} images are not supported ({', '.join(FORMATS)})")
        width, height = image.size  # from the header: a small file may claim gigabytes of pixels
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"image_url: the image has {width}x{height} pixels, over this server's limit of "
                f"{MAX_IMAGE_PIXELS} pixels"
            )
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"image_url: the image cannot be decoded ({type(exc).__name__})") from exc
    return image


def _local_file(path: str, root: Path | None) -> bytes:
    if root is None:
        raise ValueError("image_url: file:// URLs need --allowed-local-media-path on this server")
    target = Path(path).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ValueError("image_url: the file is outside --allowed-local-media-path")
    if not target.is_file() or target.stat().st_size > MAX_IMAGE_BYTES:
        raise ValueError("image_url: no such file, or it is too large")
    return target.read_bytes()
