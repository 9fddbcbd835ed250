"""Idefics3ImageProcessor (router and engine): Idefics3 / SmolVLM preprocessing from preprocessor_config.json:
RGB, resize to the longest edge, resize to whole tiles, split into tiles plus the global image, rescale,
normalise -> float32 [tiles, C, tile, tile] and the tile grid, as HF's Idefics3 image processor does."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict

from services.common.media.image_processor import MAX_PIXELS

_HARD_MAX_EDGE = 4096  # the family's absolute bound on the resized longest edge
_STANDARD = (0.5, 0.5, 0.5)


class TiledImage(BaseModel):
    """An image as the encoder sees it: ``pixels`` [tiles, C, H, W]; rows x cols tiles then the global image
    (0 x 0: the global image alone)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    pixels: np.ndarray
    rows: int
    cols: int


class Idefics3ImageProcessor(BaseModel):
    """The preprocessing steps and their parameters (HF names in ``from_folder``)."""

    model_config = ConfigDict(frozen=True)

    longest_edge: int = 4 * 364  # size.longest_edge: the resize before tiling
    tile: int = 364  # max_image_size.longest_edge: the side of a tile (and of the global image)
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, ...] = _STANDARD
    std: tuple[float, ...] = _STANDARD
    resample: int = 1  # PIL's LANCZOS

    @classmethod
    def from_folder(cls, folder: str | Path) -> Idefics3ImageProcessor:
        """The checkpoint's preprocessor_config.json (the family's defaults without one)."""
        path = Path(folder) / "preprocessor_config.json"
        cfg: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Idefics3ImageProcessor:
        size, tile = cfg.get("size") or {}, cfg.get("max_image_size") or {}
        if size and "longest_edge" not in size:
            raise ValueError(f"preprocessor_config.json: size {size} is not a longest_edge resize")
        fields: dict[str, Any] = {
            "longest_edge": size.get("longest_edge"), "tile": tile.get("longest_edge"),
            "do_resize": cfg.get("do_resize"), "do_image_splitting": cfg.get("do_image_splitting"),
            "do_rescale": cfg.get("do_rescale"), "rescale_factor": cfg.get("rescale_factor"),
            "do_normalize": cfg.get("do_normalize"), "resample": cfg.get("resample"),
            "mean": tuple(cfg["image_mean"]) if "image_mean" in cfg else None,
            "std": tuple(cfg["image_std"]) if "image_std" in cfg else None,
        }  # fmt: skip
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def max_tiles(self) -> int:
        """Tiles of the largest image (rows x cols of the longest edge's whole tiles, and the global image)."""
        if not self.do_image_splitting:
            return 1
        edge = min(self.longest_edge, _HARD_MAX_EDGE) if self.do_resize else _HARD_MAX_EDGE
        return math.ceil(edge / self.tile) ** 2 + 1

    def __call__(self, image: Image.Image) -> TiledImage:
        """One image -> its tiles (row-major) and the global image last."""
        image = _rgb(image)
        if self.do_resize:
            image = self._resize(image, *_longest_edge_size(image.height, image.width, self.longest_edge))
        rows = cols = 0
        if self.do_image_splitting:
            image = self._resize(image, *_whole_tiles_size(image.height, image.width, self.tile))
            frames, rows, cols = self._split(image)
        else:
            frames = [self._resize(image, self.tile, self.tile)]
        return TiledImage(pixels=np.stack([self.normalised(f) for f in frames]), rows=rows, cols=cols)

    def frame(self, image: Image.Image, longest_edge: int) -> np.ndarray:
        """A video frame: resized to ``longest_edge`` and then to one square tile (never split) [C, H, W]."""
        image = _rgb(image)
        if self.do_resize:
            image = self._resize(image, *_longest_edge_size(image.height, image.width, longest_edge))
        return self.normalised(self._resize(image, self.tile, self.tile))

    def normalised(self, image: Image.Image) -> np.ndarray:
        """Rescale and normalise one RGB image -> float32 [C, H, W]."""
        pixels = np.asarray(image, dtype=np.uint8).astype(np.float32)
        if self.do_rescale:
            pixels = np.asarray(pixels.astype(np.float64) * self.rescale_factor, dtype=np.float32)
        if self.do_normalize:
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            pixels = np.asarray((pixels - mean) / std, dtype=np.float32)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)

    def _split(self, image: Image.Image) -> tuple[list[Image.Image], int, int]:
        t = self.tile
        if image.height <= t and image.width <= t:
            return [image], 0, 0
        rows, cols = (image.height - t) // t + 1, (image.width - t) // t + 1
        tiles = [image.crop((c * t, r * t, c * t + t, r * t + t)) for r in range(rows) for c in range(cols)]
        return [*tiles, self._resize(image, t, t)], rows, cols

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if (image.height, image.width) == (height, width):
            return image
        return image.resize((width, height), resample=Image.Resampling(self.resample))


def _rgb(image: Image.Image) -> Image.Image:
    if image.width * image.height > MAX_PIXELS:
        raise ValueError(f"image: {image.width}x{image.height} is over {MAX_PIXELS} pixels")
    return image.convert("RGB")


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge becomes ``longest`` (the other rounded up to even), then capped at 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _HARD_MAX_EDGE:
        width, height = _HARD_MAX_EDGE, int(_HARD_MAX_EDGE / aspect)
    elif height > width and height > _HARD_MAX_EDGE:
        height, width = _HARD_MAX_EDGE, int(_HARD_MAX_EDGE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges rounded up to whole tiles, the longest first and the other from the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
