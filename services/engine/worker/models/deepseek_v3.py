"""DeepseekV3ForCausalLM: multi-head latent attention (a paged cache of latents, see mla_attention), YaRN
rotary on the rope dims, the first ``first_k_dense_replace`` layers dense and the rest DeepSeek's grouped
top-k experts with shared experts (see deepseek_moe). Plain torch attention; no tensor / pipeline
parallelism or LoRA declared yet."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvkernels.reference import build_cos_sin_cache, yarn_mscale
from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.deepseek_moe import DeepseekMoE
from services.engine.worker.models.llama import LlamaForCausalLM, LlamaMLP, RMSNorm, load_llama_weights
from services.engine.worker.models.mla_attention import LatentPlan, MLAAttention
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.rope import rope_rows

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the rope is scaled."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class DeepseekV3DecoderLayer(nn.Module):
    """MLA, then a dense SwiGLU (the first ``first_k_dense_replace`` layers) or the experts."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None = None, cache_idx: int | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_idx, softmax_scale(cfg))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = DeepseekMoE(cfg) if cfg.is_moe_layer(layer_idx) else LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        plan: LatentPlan,
        backend: Backend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, backend, residual)
        h = self.self_attn(h, rope, kv_cache, plan, backend)
        h, residual = self.post_attention_layernorm(h, backend, residual)
        return self.mlp(h, backend), residual


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Llama's embedding, final norm, logits and loader around DeepSeek-V3's layers."""

    decoder_layer = DeepseekV3DecoderLayer  # type: ignore[assignment]
    tp_plan = None
    lora_targets = None

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: the config declares no kv_lora_rank (not an MLA model)")
        super().__init__(cfg, max_positions, dtype)

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.cfg.mla is not None
        dim, theta = self.cfg.mla.qk_rope_head_dim, self.cfg.rope_theta
        return build_cos_sin_cache(dim, self.max_positions, theta, self.cfg.rope_scaling, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope, plan, residual = rope_rows(positions, self.cos_sin_cache), LatentPlan.of(meta), None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, kv_cache, plan, backend)
        assert residual is not None
        return self.norm(x, backend, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_llama_weights(self, _our_names(weights, self.cfg.num_hidden_layers), self.cfg)


def _our_names(
    weights: Iterable[tuple[str, torch.Tensor]], layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Skip the multi-token-prediction layers (numbered from ``num_hidden_layers``); HF's plain
    ``self_attn.q_proj`` is our ``q_plain`` (Llama's loader would fuse a q_proj into qkv_proj)."""
    for name, tensor in weights:
        m = _LAYER.search(name)
        if m is not None and int(m[1]) >= layers:
            continue
        yield name.replace(".self_attn.q_proj.", ".self_attn.q_plain."), tensor
