"""MLAConfig: the multi-head latent attention and grouped-routing facts of a DeepSeek-V3 config.json."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from services.engine.worker.model_config import ModelConfig

MLA_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"})
# per architecture: (routing methods served, scoring function, its default routing method)
_ROUTING = {
    "DeepseekV3ForCausalLM": (("noaux_tc",), "sigmoid", "noaux_tc"),
    "DeepseekV2ForCausalLM": (("greedy", "group_limited_greedy"), "softmax", "greedy"),
}


class MLAConfig(BaseModel):
    """What a DeepSeek-V2 / V3 layer needs beyond the Llama facts: the low-rank query / latent KV sizes, the
    rope layout, and the router (V3's ``noaux_tc``: sigmoid scores plus a correction bias choose the
    experts, the plain sigmoid scores weight them; V2's ``greedy`` / ``group_limited_greedy``: softmax
    scores, the best experts (of the best groups, each scored by its best expert))."""

    model_config = ConfigDict(frozen=True)

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek's (x0, x1), (x2, x3) rotary pairs
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    topk_method: str = "noaux_tc"

    @property
    def latent_size(self) -> int:
        """One token's cached latent per layer: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _check_supported(cfg: dict[str, Any], arch: str) -> None:
    """ValueError naming the first config field this implementation does not serve."""
    methods, scoring, default = _ROUTING[arch]
    rules: list[tuple[str, Any, tuple[Any, ...]]] = [
        ("topk_method", cfg.get("topk_method") or default, methods),
        ("scoring_func", cfg.get("scoring_func", scoring), (scoring,)),
        ("moe_layer_freq", cfg.get("moe_layer_freq", 1), (1,)),
        ("hidden_act", cfg.get("hidden_act", "silu"), ("silu",)),
        ("attention_bias", bool(cfg.get("attention_bias", False)), (False,)),
        ("quantization_config", cfg.get("quantization_config"), (None,)),
    ]
    for field, value, allowed in rules:
        if value not in allowed:
            raise ValueError(f"{field}={value!r}: {arch} supports only {list(allowed)}")
    if scoring == "softmax" and cfg.get("norm_topk_prob"):  # HF's V2 does not renormalise: no reference
        raise ValueError(f"norm_topk_prob=True: {arch}'s softmax routing is served without renormalisation")
    if (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) % 2:
        raise ValueError(
            "kv_lora_rank + qk_rope_head_dim must be even: the latent is cached split over the K and V halves"
        )
    experts, groups = cfg.get("n_routed_experts") or 0, cfg.get("n_group") or 1
    if not experts:
        raise ValueError(f"n_routed_experts: {arch} needs routed experts")
    if experts % groups or experts // groups < 2:
        raise ValueError(f"n_group={groups}: must divide n_routed_experts={experts} into groups of 2 or more")
    if not 1 <= (cfg.get("topk_group") or 1) <= groups:
        raise ValueError(f"topk_group={cfg.get('topk_group')}: must be between 1 and n_group={groups}")


def with_mla(base: ModelConfig, cfg: dict[str, Any]) -> ModelConfig:
    """``base`` (the Llama facts of ``cfg``) with the MLA facts, its MoE layout, and the KV cache's view of a
    layer: one KV "head" of half the latent, so that a block's K half and V half hold [c_kv | k_pe]."""
    arch = base.architecture
    _check_supported(cfg, arch)
    mla = MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)) or arch == "DeepseekV2ForCausalLM",
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
        topk_method=cfg.get("topk_method") or _ROUTING[arch][2],
    )
    return base.model_copy(
        update={
            "mla": mla,
            "num_key_value_heads": 1,
            "head_dim": mla.latent_size // 2,
            "num_experts": cfg["n_routed_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "mlp_only_layers": tuple(range(min(mla.first_k_dense_replace, base.num_hidden_layers))),
        }
    )
