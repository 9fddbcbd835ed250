"""ModelConfig: the architecture facts the engine needs, read from an HF config.json (v4 or v5 style)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.engine.worker.mla_config import MLA_ARCHITECTURES, MLAConfig, with_mla


class VisionTower(BaseModel):
    """A LLaVA-style model's CLIP vision tower, projector and image placeholder."""

    model_config = ConfigDict(frozen=True)

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    image_token_index: int
    feature_layer: int = -2  # which hidden state feeds the projector (HF: vision_feature_layer)
    select_strategy: str = "default"  # default: drop the CLS position; full: keep it
    projector_act: str = "gelu"
    projector_bias: bool = True
    scale_factor: int = (
        1  # Idefics3 / SmolVLM: the connector's pixel shuffle (tokens per tile = patches / s^2)
    )

    @property
    def tokens_per_image(self) -> int:
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (1 if self.select_strategy == "full" else 0)


class ModelConfig(BaseModel):
    """Llama-family architecture description (plus the few facts a BERT encoder needs)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before rotary
    # Gemma 3: the query scale's base, the sliding layers' rotary base, soft-capping
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    sliding_window: int | None = None  # attention span of a windowed family (Mistral, Phi-3)
    windowed_layers: tuple[int, ...] = ()  # the layers that use it (the others attend to everything)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): 0 experts = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert with a sigmoid gate
    decoder_sparse_step: int = 1  # every this-many-th layer is MoE (the others dense)
    mlp_only_layers: tuple[int, ...] = ()  # layers that stay dense
    # gpt-oss: per-head attention sinks, and its experts' clamped SwiGLU (None: the plain one)
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    mxfp4_experts: bool = False  # gpt-oss checkpoints: experts stored as MXFP4 blocks + scales
    vision: VisionTower | None = None  # a vision-language model (LLaVA): its tower and projector
    # DeepSeek-V3: multi-head latent attention (then num_key_value_heads = 1 and head_dim = half the latent:
    # the cache's view of one token's [c_kv | k_pe], split over a block's K and V halves)
    mla: MLAConfig | None = None
    # BERT-family encoders only (Llama ignores them)
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    position_embedding_type: str = "absolute"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [_ARCH_BY_TYPE.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if "text_config" in cfg and "vision_config" in cfg:  # LLaVA: the LM's facts, plus its tower
            text = {**cfg["text_config"], "architectures": [arch]}
            text.setdefault("eos_token_id", cfg.get("eos_token_id"))
            lm = cls.from_hf_dict(text)
            return lm.model_copy(update={"vision": _vision(cfg)})
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        per_type = isinstance(rope.get("full_attention"), dict)  # Gemma 3: one rotary setting per layer type
        local = rope.get("sliding_attention", {}) if per_type else {}
        rope = dict(rope["full_attention"]) if per_type else rope
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        base = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias or arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            type_vocab_size=cfg.get("type_vocab_size", 0),
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            position_embedding_type=cfg.get("position_embedding_type") or "absolute",
            qk_norm=arch in _QK_NORM,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            rope_local_theta=local.get("rope_theta", cfg.get("rope_local_base_freq")),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            sliding_window=_window(cfg),
            windowed_layers=_windowed_layers(cfg),
            attention_sinks=arch in _SINKS,
            swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
            swiglu_limit=cfg.get("swiglu_limit"),
            mxfp4_experts=_mxfp4(cfg, arch),
            **_moe_fields(cfg, arch),
        )
        return with_mla(base, cfg) if arch in MLA_ARCHITECTURES else base

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a mixture-of-experts MLP."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def window_of(self, layer_idx: int) -> int:
        """The attention span of decoder layer ``layer_idx`` (0: the whole context)."""
        return self.sliding_window or 0 if layer_idx in self.windowed_layers else 0

    @property
    def kv_window(self) -> int | None:
        """The window when every layer is windowed: then KV blocks before it can be freed."""
        if self.sliding_window and len(self.windowed_layers) == self.num_hidden_layers:
            return self.sliding_window
        return None

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(
                f"model: {path} has no config.json (expected an HF checkpoint folder or a .gguf file)"
            )
        cfg = json.loads(cfg_path.read_text())
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            if gen.get("eos_token_id") is not None:
                cfg["eos_token_id"] = gen["eos_token_id"]
        return cls.from_hf_dict(cfg)


_QK_NORM = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"})
_SINKS = frozenset({"GptOssForCausalLM"})


def _mxfp4(cfg: dict[str, Any], arch: str) -> bool:
    """Whether the checkpoint stores its experts as MXFP4 (``quantization_config.quant_method``); only
    gpt-oss's experts are read that way."""
    method = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower()
    if method == "mxfp4" and arch not in _SINKS:
        raise ValueError(
            f"quantization_config.quant_method=mxfp4: only gpt-oss experts are read as MXFP4, not {arch}"
        )
    return method == "mxfp4"


def _window(cfg: dict[str, Any]) -> int | None:
    """The sliding window a config declares and uses (Qwen configs carry one with use_sliding_window off)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def _windowed_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Which layers use the window: HF's ``layer_types`` when given (Qwen2/3: the layers from
    ``max_window_layers`` on), else all of them (Mistral, Phi-3, Mixtral)."""
    if _window(cfg) is None:
        return ()
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if "max_window_layers" in cfg and cfg.get("use_sliding_window"):
        return tuple(range(int(cfg["max_window_layers"]), cfg["num_hidden_layers"]))
    return tuple(range(cfg["num_hidden_layers"]))


def _vision(cfg: dict[str, Any]) -> VisionTower:
    v = cfg["vision_config"]
    siglip = cfg.get("model_type") in ("idefics3", "smolvlm")  # the whole SigLIP tower, then the connector
    layer = cfg.get("vision_feature_layer", -1 if siglip else -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: only one feature layer is supported")
    return VisionTower(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
        image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v.get("num_channels", 3),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6 if siglip else 1e-5),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu"),
        image_token_index=cfg.get("image_token_index", cfg.get("image_token_id", 32000)), feature_layer=layer,
        select_strategy=cfg.get("vision_feature_select_strategy", "default"),
        projector_act=cfg.get("projector_hidden_act", "gelu"), projector_bias=cfg.get("multimodal_projector_bias", True),
        scale_factor=cfg.get("scale_factor", 2) if siglip else 1,
    )  # fmt: skip


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The expert layout of a Mixtral / Qwen2-MoE / Qwen3-MoE / gpt-oss config (nothing for dense models)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    mixtral = arch in ("MixtralForCausalLM", "GptOssForCausalLM")  # experts as wide as intermediate_size
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
        "norm_topk_prob": True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
        "decoder_sparse_step": cfg.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
    }


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "bert": "BertModel",
}
