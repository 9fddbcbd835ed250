"""Model registry: config.json `architectures` -> model class."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from services.engine.worker.models.bert import BertModel
from services.engine.worker.models.llama import LlamaForCausalLM

_REGISTRY: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
    }
)
# Encoders: no KV cache, no logits; they serve embeddings only (see services.engine.worker.pooling).
_ENCODERS: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "BertModel": BertModel,
        "BertForMaskedLM": BertModel,
    }
)


def supported_architectures() -> list[str]:
    return sorted([*_REGISTRY, *_ENCODERS])


def is_encoder_architecture(architecture: str) -> bool:
    """True for encoder (embedding-only) models: bidirectional attention, no KV cache, no compute_logits."""
    return architecture in _ENCODERS


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an architecture name; a clear error listing the supported ones otherwise."""
    cls = _REGISTRY.get(architecture) or _ENCODERS.get(architecture)
    if cls is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(sorted(_REGISTRY))}; "
            f"encoder (embedding) models: {', '.join(sorted(_ENCODERS))}"
        )
    return cls
