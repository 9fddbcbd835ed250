"""Idefics3Placeholders: Idefics3 / SmolVLM prompt expansion in token ids. An ``<image>`` becomes its tiles
(``<fake_token_around_image><row_r_col_c>`` + image tokens, a newline after each row) and the global image
(``<fake_token_around_image><global-img>`` + image tokens + ``<fake_token_around_image>``); a ``<video>``
becomes SmolVLM's frame prompt (an intro with the frame count and duration, then per frame its timestamp
and a global image). Router and engine both use it, so the ids and image hashes they compute are the same."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from services.common.media.idefics3_processor import Idefics3ImageProcessor
from services.common.media.image_inputs import PlacedImage, content_hash
from services.common.media.number_words import number_words
from services.common.media.video_inputs import VideoClip, VideoSampling
from services.common.openai.tokenizer import Tokenizer

FAMILIES = ("idefics3", "smolvlm")
Media = Image.Image | VideoClip


class Idefics3Placeholders:
    """The family's special tokens, image tokens per tile, preprocessing and (SmolVLM) video settings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        processor: Idefics3ImageProcessor,
        seq_len: int,
        video: VideoSampling | None = None,
    ) -> None:
        self.tok, self.processor, self.seq_len, self.video_sampling = tokenizer, processor, seq_len, video
        ids = {
            t: tokenizer.backend.token_to_id(t)
            for t in ("<image>", "<fake_token_around_image>", "<global-img>")
        }
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer: the Idefics3 tokens {missing} are missing")
        self.token_id, self.fake, self.global_img = (
            ids["<image>"],
            ids["<fake_token_around_image>"],
            ids["<global-img>"],
        )
        self.video_token_id: int | None = (
            tokenizer.backend.token_to_id("<video>") if video is not None else None
        )
        self.added = frozenset(tokenizer.backend.get_added_tokens_decoder())  # where text runs end

    @staticmethod
    def serves(cfg: dict[str, Any]) -> bool:
        """An Idefics3 / SmolVLM config.json (its model_type, with a vision tower)."""
        return cfg.get("model_type") in FAMILIES and bool(cfg.get("vision_config"))

    @classmethod
    def from_model_dir(cls, folder: str | Path, cfg: dict[str, Any]) -> Idefics3Placeholders:
        """From an Idefics3 / SmolVLM checkpoint: config.json (``cfg``), processor and video configs."""
        folder = Path(folder)
        v = cfg["vision_config"]
        seq_len = (v.get("image_size", 224) // v.get("patch_size", 32)) ** 2 // cfg.get(
            "scale_factor", 2
        ) ** 2
        proc_file = folder / "processor_config.json"
        declared = json.loads(proc_file.read_text()).get("image_seq_len") if proc_file.is_file() else None
        if declared is not None and declared != seq_len:
            raise ValueError(f"{proc_file}: image_seq_len {declared}, but the model gives {seq_len} per tile")
        processor = Idefics3ImageProcessor.from_folder(folder)
        patch = v.get("patch_size", 32)
        if processor.tile // patch != v.get("image_size", 224) // patch:
            raise ValueError(
                f"{folder}: tiles of {processor.tile} px (max_image_size) but a vision tower of "
                f"{v.get('image_size', 224)} px: the features per tile would not match the image tokens"
            )
        return cls(Tokenizer(folder), processor, seq_len, _video_sampling(folder))

    @property
    def tokens_per_tile(self) -> int:
        return self.seq_len

    @property
    def max_item_embeds(self) -> int:
        """Features of the largest image or video (an encoder step must have room for one)."""
        frames = self.video_sampling.max_frames if self.video_sampling is not None else 0
        return max(self.processor.max_tiles, frames) * self.seq_len

    def expand(self, token_ids: Sequence[int], media: Sequence[Media]) -> tuple[list[int], list[PlacedImage]]:
        """Each ``<image>`` / ``<video>`` marker -> its expansion, the media taken in order per kind; ids that
        are already expanded (as the router sends them) are kept and the media found in them in order."""
        images = [m for m in media if not isinstance(m, VideoClip)]
        videos = [m for m in media if isinstance(m, VideoClip)]
        if videos and self.video_token_id is None:
            raise ValueError("videos: this model takes images only (no video settings in its processor)")
        n_img = sum(1 for t in token_ids if t == self.token_id)
        n_vid = sum(1 for t in token_ids if t == self.video_token_id)
        if (n_img, n_vid) != (len(images), len(videos)) and n_img > len(images):
            return self._locate(list(token_ids), images, videos)
        if (n_img, n_vid) != (len(images), len(videos)):
            raise ValueError(
                f"images: the prompt has {n_img} image and {n_vid} video placeholder(s) for {len(images)} "
                f"image(s) and {len(videos)} video(s)"
            )
        return self._expand_markers(list(token_ids), iter(images), iter(videos))

    def _expand_markers(
        self, token_ids: list[int], images: Iterator[Image.Image], videos: Iterator[VideoClip]
    ) -> tuple[list[int], list[PlacedImage]]:
        """A video's prompt begins and ends in text: it is tokenized with the text around its marker (back
        and forward to the nearest added token), so the ids equal HF's text-level replacement."""
        out: list[int] = []
        placed: list[PlacedImage] = []
        i = 0
        while i < len(token_ids):
            t = token_ids[i]
            i += 1
            if t == self.token_id:
                ids, item = self._item(next(images))
            elif t == self.video_token_id:
                start = len(out)
                while start and out[start - 1] not in self.added:
                    start -= 1
                end = i
                while end < len(token_ids) and token_ids[end] not in self.added:
                    end += 1
                before, after = self._decode(out[start:]), self._decode(token_ids[i:end])
                del out[start:]
                ids, item = self._video(next(videos), before, after)
                i = end
            else:
                out.append(t)
                continue
            placed.append(_shifted(item, len(out)))
            out.extend(ids)
        return out, placed

    def _item(self, m: Media) -> tuple[list[int], PlacedImage]:
        """One image or video: its expansion ids and its placement relative to their start."""
        if isinstance(m, VideoClip):
            return self._video(m)
        tiled = self.processor(m)
        ids = self._tiles(tiled.rows, tiled.cols)
        return ids, self._placed(ids, 0, len(ids), tiled.pixels)

    def _tiles(self, rows: int, cols: int) -> list[int]:
        ids: list[int] = []
        for r in range(rows):
            for c in range(cols):
                ids += [self.fake, self._row_col(r + 1, c + 1), *[self.token_id] * self.seq_len]
            ids += self._text("\n" if r < rows - 1 else "\n\n")
        return ids + self._global()

    def _global(self) -> list[int]:
        return [self.fake, self.global_img, *[self.token_id] * self.seq_len, self.fake]

    def _video(self, clip: VideoClip, before: str = "", after: str = "") -> tuple[list[int], PlacedImage]:
        """SmolVLM's frame prompt between the texts ``before`` and ``after`` it; the span runs from the first
        frame's image to the last one's (the intro and the text around it are plain tokens)."""
        assert self.video_sampling is not None
        edge = self.video_sampling.longest_edge
        pixels = np.stack([self.processor.frame(Image.fromarray(f), edge) for f in clip.frames])
        text = before + (
            f"You are provided the following series of {number_words(len(pixels))} frames from a "
            f"{timedelta(seconds=int(clip.duration))} [H:MM:SS] video.\n"
        )
        ids: list[int] = []
        for t in clip.timestamps:
            ids += self._text(text + f"\nFrame from {int(t // 60):02d}:{int(t % 60):02d}:")
            text = ""
            ids += self._global()
        begin, end = ids.index(self.fake), len(ids)
        return ids + self._text("\n\n" + after), self._placed(ids, begin, end, pixels)

    def _placed(self, ids: list[int], start: int, end: int, pixels: Any) -> PlacedImage:
        is_embed = tuple(t == self.token_id for t in ids[start:end])
        return PlacedImage(start, end - start, content_hash(pixels), pixels, is_embed)

    def _locate(
        self, token_ids: list[int], images: list[Image.Image], videos: list[VideoClip]
    ) -> tuple[list[int], list[PlacedImage]]:
        placed = []
        for group in (images, videos):
            cursor = 0
            for m in group:
                ids, item = self._item(m)
                at = _find(token_ids, ids[item.start : item.start + item.length], cursor)
                if at < 0:
                    raise ValueError("images: the prompt's expanded image tokens do not match the images")
                placed.append(_shifted(item, at - item.start))
                cursor = at + item.length
        return token_ids, sorted(placed, key=lambda p: p.start)

    def _row_col(self, r: int, c: int) -> int:
        token = self.tok.backend.token_to_id(f"<row_{r}_col_{c}>")
        if token is None:
            raise ValueError(f"images: the tokenizer has no <row_{r}_col_{c}> token for this image's tiles")
        return int(token)

    def _text(self, text: str) -> list[int]:
        return list(self.tok.backend.encode(text, add_special_tokens=False).ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.backend.decode(ids, skip_special_tokens=False)) if ids else ""


def _shifted(item: PlacedImage, offset: int) -> PlacedImage:
    return PlacedImage(item.start + offset, item.length, item.content_hash, item.pixels, item.is_embed)


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    first, n = needle[0], len(needle)
    for i in range(start, len(haystack) - n + 1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return -1


def _video_sampling(folder: Path) -> VideoSampling | None:
    """SmolVLM's video_preprocessor_config.json ``video_sampling`` (None: the checkpoint takes no video)."""
    path = folder / "video_preprocessor_config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    sampling = cfg.get("video_sampling") or {}
    size = sampling.get("video_size") or cfg.get("size") or {}
    return VideoSampling(
        fps=sampling.get("fps", cfg.get("fps", 1)),
        max_frames=sampling.get("max_frames", cfg.get("num_frames", 64)),
        longest_edge=size.get("longest_edge", 512),
    )
