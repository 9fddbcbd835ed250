"""ImageProcessor (router and engine): a checkpoint's CLIP-style preprocessing (preprocessor_config.json): RGB, resize the
shortest edge, centre crop, rescale, normalise -> float32 [C, H, W], as HF's CLIPImageProcessor does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_PIXELS = 40_000_000  # a decoded image larger than this is refused (decompression bombs)


class ImageProcessor(BaseModel):
    """The preprocessing steps and their parameters."""

    model_config = ConfigDict(frozen=True)

    shortest_edge: int
    crop: tuple[int, int]  # (height, width)
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD
    resample: int = 3  # PIL's BICUBIC

    @classmethod
    def from_folder(cls, folder: str | Path, image_size: int) -> ImageProcessor:
        """The checkpoint's preprocessor_config.json; without one, CLIP's defaults at ``image_size``."""
        path = Path(folder) / "preprocessor_config.json"
        cfg: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        size = cfg.get("size", {"shortest_edge": image_size})
        crop = cfg.get("crop_size", {"height": image_size, "width": image_size})
        edge = size.get("shortest_edge") if isinstance(size, dict) else size
        if isinstance(size, dict) and edge is None:
            raise ValueError(
                f"{path}: size {size} is not a shortest_edge resize (only CLIP-style is supported)"
            )
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=int(edge or image_size), crop=(crop["height"], crop["width"]),
            do_resize=cfg.get("do_resize", True), do_center_crop=cfg.get("do_center_crop", True),
            do_rescale=cfg.get("do_rescale", True), rescale_factor=cfg.get("rescale_factor", 1 / 255),
            do_normalize=cfg.get("do_normalize", True), mean=tuple(cfg.get("image_mean", _CLIP_MEAN)),
            std=tuple(cfg.get("image_std", _CLIP_STD)), resample=cfg.get("resample", 3),
        )  # fmt: skip

    def __call__(self, image: Image.Image) -> np.ndarray:
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"image: {image.width}x{image.height} is over {MAX_PIXELS} pixels")
        image = image.convert("RGB")
        if self.do_resize:
            short, long = sorted((image.width, image.height))
            new_long = int(self.shortest_edge * long / short)
            w, h = (
                (self.shortest_edge, new_long)
                if image.width <= image.height
                else (new_long, self.shortest_edge)
            )
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        if self.do_center_crop:
            ch, cw = self.crop
            top, left = (image.height - ch) // 2, (image.width - cw) // 2
            image = image.crop((left, top, left + cw, top + ch))
        pixels = np.asarray(image, dtype=np.uint8).astype(np.float32)
        if self.do_rescale:
            pixels = np.asarray(pixels.astype(np.float64) * self.rescale_factor, dtype=np.float32)
        if self.do_normalize:
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            pixels = np.asarray((pixels - mean) / std, dtype=np.float32)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
