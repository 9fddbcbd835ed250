"""ModelCapabilities: what a model class declares it supports (tensor parallelism, LoRA, pipeline stages,
vision), read once when the class is registered or looked up, never probed again at load or step time."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from services.engine.worker.model_config import ModelConfig

# a module's LoRA shard output sizes and input size, by our module path
LoRAShapes = dict[str, tuple[list[int], int]]


@dataclass(frozen=True)
class TPPlan:
    """How tensor parallelism cuts a model's checkpoint tensors, by the module name before ``.weight``.

    ``column``: output rows split evenly; ``kv``: output rows by KV head (replicated when there are fewer
    heads than ranks); ``row``: input columns split, the partial sums all-reduced (rank 0 keeps the bias);
    ``vocab``: vocabulary rows, the last shard padded; ``fused``: one tensor of stacked parts, each part
    ``"q"`` (the query heads), ``"kv"`` (one KV projection) or ``"half"`` (an even half, split evenly).
    Everything else (norms, routers) is replicated, as is every tensor whose name holds one of
    ``replicated`` (a vision tower and its projector beside a sharded language model).
    """

    column: frozenset[str] = frozenset()
    kv: frozenset[str] = frozenset()
    row: frozenset[str] = frozenset()
    vocab: frozenset[str] = frozenset()
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    replicated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = {p for parts in self.fused.values() for p in parts} - {"q", "kv", "half"}
        if bad:
            raise ValueError(f"tp_plan.fused: unknown part kinds {sorted(bad)} (known: q, kv, half)")


@dataclass(frozen=True)
class LoRATargets:
    """What LoRA adapters may target: each fused module of a decoder layer (our path, e.g.
    ``self_attn.qkv_proj``) with the PEFT target names of its parts in row order; ``lm_head`` and
    ``embed_tokens`` are targets of every model that has them. ``shapes`` gives each module's part output
    sizes and input size for a config."""

    layer_modules: Mapping[str, tuple[str, ...]]
    shapes: Callable[[ModelConfig], LoRAShapes]

    def target_index(self) -> dict[str, tuple[str, int]]:
        """PEFT target name -> (our module path, part index)."""
        index = {t: (m, i) for m, targets in self.layer_modules.items() for i, t in enumerate(targets)}
        return index | {"lm_head": ("lm_head", 0), "embed_tokens": ("embed_tokens", 0)}


@dataclass(frozen=True)
class ModelCapabilities:
    """A model class's declarations, checked when it is looked up (ValueError naming a malformed one)."""

    tp_plan: TPPlan | None  # class attribute ``tp_plan``: tensor parallelism
    lora: LoRATargets | None  # class attribute ``lora_targets``: multi-LoRA
    pipeline: bool  # the constructor takes ``pp`` (a PPStage): pipeline parallelism
    vision: bool  # ``encode_images``: image inputs
    logits: bool  # ``compute_logits``: generation (else embeddings only)

    @classmethod
    def of(cls, model_class: type[nn.Module]) -> ModelCapabilities:
        """The declarations of ``model_class``."""
        name = model_class.__name__
        tp_plan = getattr(model_class, "tp_plan", None)
        if tp_plan is not None and not isinstance(tp_plan, TPPlan):
            raise ValueError(f"model class {name}: tp_plan must be a TPPlan, not {type(tp_plan).__name__}")
        lora = getattr(model_class, "lora_targets", None)
        if lora is not None and not isinstance(lora, LoRATargets):
            raise ValueError(
                f"model class {name}: lora_targets must be LoRATargets, not {type(lora).__name__}"
            )
        params = inspect.signature(model_class.__init__).parameters
        if tp_plan is not None and "tp" not in params:
            raise ValueError(f"model class {name}: it declares a tp_plan but its constructor takes no `tp`")
        return cls(
            tp_plan=tp_plan,
            lora=lora,
            pipeline="pp" in params,
            vision=callable(getattr(model_class, "encode_images", None)),
            logits=callable(getattr(model_class, "compute_logits", None)),
        )
