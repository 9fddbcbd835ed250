"""EncoderCache: image features by content hash (LRU within a byte budget), and their merge into a
step's input embeddings at the placeholder rows the step computes (a chunk may cut an image)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from services.engine.core.mm_input import MMInput

DEFAULT_BUDGET_BYTES = 512 * 2**20


class VisionModel(Protocol):
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class EncoderCache:
    """Features [tokens, hidden] of recently seen images; ``queries`` / ``hits`` count lookups."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.queries = 0
        self.hits = 0

    def features(self, model: VisionModel, mm: MMInput, device: torch.device) -> torch.Tensor:
        self.queries += 1
        found = self.entries.get(mm.content_hash)
        if found is not None:
            self.hits += 1
            self.entries.move_to_end(mm.content_hash)
            return found
        pixels = torch.from_numpy(np.asarray(mm.data)).to(device)
        # one image [C, H, W] (LLaVA), or its tiles / a video's frames [N, C, H, W]: features of all, in order
        feats = model.encode_images(pixels if pixels.ndim == 4 else pixels[None]).flatten(0, 1)
        if feats.shape[0] != mm.num_embeds:
            raise ValueError(
                f"image: the encoder gave {feats.shape[0]} features for {mm.num_embeds} placeholders"
            )
        self.entries[mm.content_hash] = feats
        self.bytes += feats.numel() * feats.element_size()
        while self.bytes > self.budget and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return feats


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
