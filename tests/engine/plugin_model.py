"""Model plugins for the capability tests: Llama-shaped classes that declare (or do not declare) what they
support, registered through a ``kvferry.models`` entry point as a pip-installed package would be."""

from __future__ import annotations

from types import MappingProxyType

from services.engine.worker.models.capabilities import LoRATargets, TPPlan
from services.engine.worker.models.llama import LlamaForCausalLM, lora_shapes


class DeclaredLM(LlamaForCausalLM):
    """Declares its own tensor-parallel plan and LoRA targets (attention only)."""

    tp_plan = TPPlan(
        column=frozenset({"q_proj", "gate_proj", "up_proj"}),
        kv=frozenset({"k_proj", "v_proj"}),
        row=frozenset({"o_proj", "down_proj"}),
        vocab=frozenset({"embed_tokens", "lm_head"}),
    )
    lora_targets = LoRATargets(
        layer_modules=MappingProxyType({"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj")}),
        shapes=lora_shapes,
    )


class BareLM(LlamaForCausalLM):
    """Declares neither: tensor parallelism and LoRA are refused for it, naming the missing declaration."""

    tp_plan = None
    lora_targets = None
