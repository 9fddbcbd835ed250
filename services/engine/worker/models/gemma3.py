"""Gemma3ForCausalLM (text): the Llama machinery with Gemma 3's differences: sandwich norms around attention
and MLP, norms that scale by (1 + w), q/k norms, a scaled embedding, GELU-tanh MLP, 5:1 sliding/global
layers with their own rotary bases, the query scale from ``query_pre_attn_scalar``, optional final
logit soft-capping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvkernels.reference import build_cos_sin_cache
from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from services.engine.worker.parallel.pp_stage import PPStage, stage_layers
from services.engine.worker.parallel.tp_group import TPGroup


class GeluMLP(LlamaMLP):
    """gate/up -> GELU (tanh approximation) x up -> down."""

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """norm -> attention -> norm, added; norm -> MLP -> norm, added (the adds fused into the next norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None, cache_idx: int) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, cache_idx)
        self.self_attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeluMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, backend, residual)
        h = self.self_attn(h, rope, kv_cache, meta, backend)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        h = self.post_attention_layernorm(h, backend)[0]
        h, residual = self.pre_feedforward_layernorm(h, backend, residual)
        out = self.mlp(h, backend)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return self.post_feedforward_layernorm(out, backend)[0], residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's embedding, stages, logits and loader, with Gemma 3's layers."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
    ) -> None:
        if cfg.attn_logit_softcapping is not None:
            raise ValueError(
                f"attn_logit_softcapping={cfg.attn_logit_softcapping}: soft-capped attention scores are not "
                "supported (no attention backend caps them)"
            )
        super().__init__(cfg, max_positions, dtype, tp, pp)
        shard = self.cfg  # the rank's shard config (LlamaForCausalLM's)
        owned = stage_layers(shard.num_hidden_layers, pp)
        for i in owned:
            self.layers[i] = Gemma3DecoderLayer(shard, i, tp, i - owned.start)
        # sqrt(hidden) rounded to the model's dtype, as HF multiplies by it (a plain float: no tensor per step)
        self.embed_scale = float(torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype, device="cpu"))
        self._local_rope: torch.Tensor | None = None

    def _local_cache(self) -> torch.Tensor:
        """The sliding layers' rotary table (their own base, no scaling), built on first use."""
        like = self.cos_sin_cache
        if self._local_rope is None or self._local_rope.device != like.device:
            theta = self.cfg.rope_local_theta or self.cfg.rope_theta
            table = build_cos_sin_cache(self.cfg.head_dim, self.max_positions, theta, None, like.dtype)
            self._local_rope = table.to(like.device)
        return self._local_rope

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_ids(input_ids) * self.embed_scale

    def rope_tables(self) -> tuple[torch.Tensor, ...]:
        return (self.cos_sin_cache, self._local_cache())

    def rope_of(self, layer: int) -> int:
        return 1 if layer in self.cfg.windowed_layers else 0

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, fp32=True)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if fp32 else logits.to(hidden.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Gemma's norms scale by (1 + w): the stored w are shifted by one as they load."""
        super().load_weights((n, t + 1 if n.endswith("norm.weight") else t) for n, t in weights)
