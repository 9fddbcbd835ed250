"""VisionLanguageModel: what every vision-language family shares: a Llama-family LM that runs the prompt (its
image placeholders' embeddings replaced by the family's image features) and the loader's hooks into it."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LlamaForCausalLM
from services.engine.worker.parallel.tp_group import TPGroup


class VisionLanguageModel(nn.Module, abc.ABC):
    """The LM part; a family adds its tower and ``encode_images`` ([N, C, H, W] -> [N, tokens, hidden])."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        """``tp``: the language model holds this rank's shard; the tower and projector are replicated."""
        super().__init__()
        if cfg.vision is None:
            raise ValueError(f"{cfg.architecture} needs a vision_config")
        self.cfg = cfg
        text = cfg.model_copy(update={"vision": None})
        self.language_model = LlamaForCausalLM(text, max_positions, dtype, tp=tp)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.language_model.cos_sin_cache

    @cos_sin_cache.setter
    def cos_sin_cache(self, value: torch.Tensor) -> None:  # the loader builds it after to_empty
        self.language_model.cos_sin_cache = value

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        return self.language_model.build_rope_cache(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_cache, meta, backend, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, fp32)

    @abc.abstractmethod
    def vision_target(self, name: str) -> str | None:
        """Our name of a checkpoint's tower / projector tensor; None: the LM's tensor; "": one never read."""

    def language_name(self, name: str) -> str:
        """A checkpoint's LM tensor name as the Llama loader's."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tower and projector here (vision_target), the rest to the LM (ValueError naming a stray,
        misshapen or missing tensor)."""
        own = dict(self.named_parameters())
        filled: set[str] = set()

        def language() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                target = self.vision_target(name)
                if target is None:
                    yield self.language_name(name), tensor
                    continue
                if not target:
                    continue
                if target not in own:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
                if own[target].shape != tensor.shape:
                    raise ValueError(
                        f"weight shape mismatch for {name}: {tuple(own[target].shape)} vs {tuple(tensor.shape)}"
                    )
                own[target].data.copy_(tensor.to(own[target].dtype))
                filled.add(target)

        self.language_model.load_weights(language())
        missing = [n for n in own if not n.startswith("language_model.") and n not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}")
