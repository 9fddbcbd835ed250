"""Model registry: config.json `architectures` -> model class."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType

from torch import nn

from services.engine.worker.models.bert import BertModel
from services.engine.worker.models.capabilities import ModelCapabilities
from services.engine.worker.models.deepseek_v3 import DeepseekV3ForCausalLM
from services.engine.worker.models.gemma3 import Gemma3ForCausalLM
from services.engine.worker.models.gpt_oss import GptOssForCausalLM
from services.engine.worker.models.idefics3 import Idefics3ForConditionalGeneration
from services.engine.worker.models.llama import LlamaForCausalLM
from services.engine.worker.models.llava import LlavaForConditionalGeneration

_REGISTRY: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
        "Phi3ForCausalLM": LlamaForCausalLM,
        "MixtralForCausalLM": LlamaForCausalLM,
        "Qwen2MoeForCausalLM": LlamaForCausalLM,
        "Qwen3MoeForCausalLM": LlamaForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        "GptOssForCausalLM": GptOssForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
        "DeepseekV2ForCausalLM": DeepseekV3ForCausalLM,  # the same MLA, V2's softmax routing
        "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
        "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
        "SmolVLMForConditionalGeneration": Idefics3ForConditionalGeneration,
    }
)
# Encoders: no KV cache, no logits; they serve embeddings only (see services.engine.worker.pooling).
_ENCODERS: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "BertModel": BertModel,
        "BertForMaskedLM": BertModel,
    }
)


PLUGIN_GROUP = "kvferry.models"  # entry points: architecture name -> "module:Class"


def _plugins() -> dict[str, EntryPoint]:
    """Model classes other packages register (looked up when a model is built, in that process)."""
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def supported_architectures() -> list[str]:
    return sorted({*_REGISTRY, *_ENCODERS, *_plugins()})


def is_encoder_architecture(architecture: str) -> bool:
    """True for encoder (embedding-only) models: bidirectional attention, no KV cache, no compute_logits."""
    return architecture in _ENCODERS


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an architecture name: built in, or from a ``kvferry.models`` entry point; a clear
    error listing both otherwise. A plugin class is built as ``cls(ModelConfig, max_positions, dtype)``
    and implements the ``CausalLM`` protocol (services.engine.worker.models.interface); what else it
    supports it declares (services.engine.worker.models.capabilities: ``tp_plan``, ``lora_targets``, a
    ``pp`` constructor argument, ``encode_images``)."""
    cls = _REGISTRY.get(architecture) or _ENCODERS.get(architecture)
    if cls is not None:
        return cls
    plugins = _plugins()
    if architecture in plugins:
        loaded = plugins[architecture].load()
        if not (isinstance(loaded, type) and issubclass(loaded, nn.Module)):
            raise ValueError(
                f"model plugin {architecture!r} ({plugins[architecture].value}) is not an nn.Module class"
            )
        ModelCapabilities.of(loaded)  # its declarations are well formed (ValueError naming one)
        return loaded
    raise ValueError(
        f"model architecture {architecture!r} is not supported; supported: {', '.join(sorted(_REGISTRY))}; "
        f"encoder (embedding) models: {', '.join(sorted(_ENCODERS))}; "
        f"plugins ({PLUGIN_GROUP} entry points): {', '.join(sorted(plugins)) or 'none installed'}"
    )
