"""VisionStep: a vision-language model's part of a step: encode the scheduled images, merge their features."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.engine.core.outputs import SchedulerOutput
from services.engine.worker.input_batch import CachedRequestState, StepInputs
from services.engine.worker.multimodal.encoder_cache import EncoderCache, VisionModel, merged_embeddings


class VisionStep:
    """The encoder cache of a model with a vision tower, and what each step does with it."""

    serves = True

    def __init__(self, model: VisionModel, device: torch.device) -> None:
        self.model, self.device, self.cache = model, device, EncoderCache()

    def drop(self, hashes: tuple[str, ...] | list[str]) -> None:
        """Forget the features the scheduler evicted."""
        self.cache.drop(hashes)

    def encode(self, sched: SchedulerOutput, states: Mapping[str, CachedRequestState]) -> None:
        """The step's scheduled images and videos through the vision tower, batched, into the cache."""
        if sched.encoder_inputs:
            items = [states[rid].mm_inputs[i] for rid, i in sched.encoder_inputs]
            self.cache.encode(self.model, items, self.device)

    def embeddings(
        self, sched: SchedulerOutput, inputs: StepInputs, states: Mapping[str, CachedRequestState]
    ) -> torch.Tensor | None:
        """Input embeddings with the images' features where this step computes their placeholders (None: no
        request of the step has images, the model embeds the ids itself)."""
        rows = []
        starts: list[int] | None = None
        for i, (req_id, n) in enumerate(sched.num_scheduled_tokens):
            st = states[req_id]
            if st.mm_inputs:
                starts = starts if starts is not None else inputs.meta.query_start_loc.tolist()
                rows.append((starts[i], st.num_computed, st.num_computed + n, st.mm_inputs))
        return merged_embeddings(self.model, inputs.input_ids, rows, self.cache) if rows else None
