"""Model registry: config.json `architectures` -> model class."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from services.engine.worker.models.llama import LlamaForCausalLM

_REGISTRY: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
    }
)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an architecture name; a clear error listing the supported ones otherwise."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None
