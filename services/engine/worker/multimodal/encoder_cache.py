"""EncoderCache: image features by content hash, computed as the step's batched encoder pass and evicted as
the scheduler says; and their merge into a step's input embeddings at the placeholder rows the step computes
(a chunk may cut an image)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from services.engine.core.mm_input import MMInput

DEFAULT_BUDGET_BYTES = 512 * 2**20  # the scheduler's EncoderCacheManager holds this many bytes of features

log = logging.getLogger(__name__)


class VisionModel(Protocol):
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class EncoderCache:
    """Features [tokens, hidden] by content hash: filled by ``encode`` (the step's images as one batch per
    tile shape), emptied by ``drop`` (what the scheduler's EncoderCacheManager evicted)."""

    def __init__(self) -> None:
        self.entries: dict[str, torch.Tensor] = {}
        self.encoder_calls = 0  # encode_images calls (batches), since start
        self.encoded_items = 0  # images and videos encoded, since start

    def drop(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self.entries.pop(h, None)

    def encode(self, model: VisionModel, items: Sequence[MMInput], device: torch.device) -> None:
        """Encode ``items`` (each [C, H, W], or its tiles / frames [N, C, H, W]) in one batch per tile shape."""
        groups: dict[tuple[int, ...], list[tuple[MMInput, torch.Tensor]]] = {}
        for mm in items:
            if mm.content_hash in self.entries:
                continue
            pixels = torch.from_numpy(np.asarray(mm.data))
            pixels = pixels if pixels.ndim == 4 else pixels[None]
            groups.setdefault(tuple(pixels.shape[1:]), []).append((mm, pixels))
        for group in groups.values():
            batch = torch.cat([p for _, p in group]).to(device)
            feats = model.encode_images(batch)
            self.encoder_calls += 1
            offset = 0
            for mm, pixels in group:
                self._store(mm, feats[offset : offset + pixels.shape[0]].flatten(0, 1))
                offset += pixels.shape[0]

    def _store(self, mm: MMInput, feats: torch.Tensor) -> None:
        if feats.shape[0] != mm.num_embeds:
            raise ValueError(
                f"image: the encoder gave {feats.shape[0]} features for {mm.num_embeds} placeholders"
            )
        self.entries[mm.content_hash] = feats
        self.encoded_items += 1

    def features(self, model: VisionModel, mm: MMInput, device: torch.device) -> torch.Tensor:
        """An image's features; one the step did not encode (a failed earlier step) is encoded alone."""
        found = self.entries.get(mm.content_hash)
        if found is None:
            log.warning("encoder cache miss for an image the scheduler counted as cached: encoding it now")
            self.encode(model, [mm], device)
            found = self.entries[mm.content_hash]
        return found


def merged_embeddings(
    model: VisionModel,
    input_ids: torch.Tensor,
    rows: Sequence[tuple[int, int, int, tuple[MMInput, ...]]],
    cache: EncoderCache,
) -> torch.Tensor | None:
    """The step's input embeddings with image features at their placeholders (None when the step computes
    no image token). rows: (first row in the batch, first position, end position, the request's images)."""
    spans = [
        (off, start, end, mm)
        for off, start, end, mms in rows
        for mm in mms
        if mm.start < end and mm.end > start
    ]
    if not spans:
        return None
    embeds = model.embed(input_ids)
    for off, start, end, mm in spans:
        lo, hi = max(start, mm.start), min(end, mm.end)
        feats = cache.features(model, mm, input_ids.device)
        if mm.is_embed is None:
            embeds[off + lo - start : off + hi - start] = feats[lo - mm.start : hi - mm.start].to(
                embeds.dtype
            )
            continue
        window = mm.is_embed[lo - mm.start : hi - mm.start]
        first = sum(mm.is_embed[: lo - mm.start])  # features before this step's window
        targets = [off + lo - start + i for i, e in enumerate(window) if e]
        if targets:
            index = torch.tensor(targets, device=embeds.device)
            embeds[index] = feats[first : first + len(targets)].to(embeds.dtype)
    return embeds
