"""LlamaForCausalLM and its family (Mistral, Qwen2/3, Phi-3, and the MoE Mixtral / Qwen2-MoE / Qwen3-MoE):
RMSNorm, GQA attention over the paged cache (Qwen3's q/k norms), SwiGLU or routed experts, RoPE."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from kvkernels.reference import build_cos_sin_cache
from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.capabilities import LoRAShapes, LoRATargets, TPPlan
from services.engine.worker.models.moe import MoEBlock, expert_shard, moe_name
from services.engine.worker.parallel.pp_stage import PPStage, stage_layers
from services.engine.worker.parallel.tp_group import TPGroup, shard_config


class RMSNorm(nn.Module):
    """RMSNorm weights; the math (HF semantics, optional fused residual add) is the backend's."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return backend.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_idx: int | None = None) -> None:
        """``cache_idx``: this layer's index in the KV cache (a pipeline stage holds only its layers')."""
        super().__init__()
        self.layer_idx = layer_idx
        self.cache_idx = layer_idx if cache_idx is None else cache_idx
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.d**-0.5
        self.window = cfg.window_of(layer_idx)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # gpt-oss: a learned logit per query head in its softmax denominator (backend.attention's sinks)
        self.sinks = nn.Parameter(torch.empty(self.hq), requires_grad=False) if cfg.attention_sinks else None

    def forward(
        self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: Backend
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norms before rotary
            q = self.q_norm(q.reshape(t * self.hq, self.d), backend)[0]
            k = self.k_norm(k.reshape(t * self.hkv, self.d), backend)[0]
        q, k = backend.rotary(q.reshape(t, self.hq, self.d), k.reshape(t, self.hkv, self.d), rope)
        v = v.view(t, self.hkv, self.d)
        if self.sinks is None:
            out = backend.attention(q, k, v, kv_cache, self.cache_idx, meta, self.scale, self.window)
        else:
            out = backend.attention(
                q, k, v, kv_cache, self.cache_idx, meta, self.scale, self.window, self.sinks
            )
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        self.inter = intermediate or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP; under tensor parallelism each ends with the all-reduce of its partial sums."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None = None, cache_idx: int | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, cache_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer_idx, tp)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None) -> nn.Module:
        """The layer's MLP: SwiGLU, or routed experts (with Qwen2-MoE's shared expert) in MoE layers."""
        if cfg.is_moe_layer(layer_idx):
            shared = cfg.shared_expert_intermediate_size
            return MoEBlock(cfg, LlamaMLP(cfg, shared) if shared else None, tp)
        return LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's MLP output (or the embeddings); the residual add is fused into the norm."""
        h, residual = self.input_layernorm(x, backend, residual)
        h = self.self_attn(h, rope, kv_cache, meta, backend)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        h, residual = self.post_attention_layernorm(h, backend, residual)
        out = self.mlp(h, backend)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out, residual


def rope_cache(cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_positions, head_dim]: cos half then sin half (HF rotary semantics)."""
    return build_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)


# fused linear -> its checkpoint shards in row order (the quantization plan fuses them too)
PACKED_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
)


def lora_shapes(cfg: ModelConfig) -> LoRAShapes:
    """Each LoRA-able module's part output sizes and input size, by our module names."""
    q, kv, h = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size
    return {
        "self_attn.qkv_proj": ([q, kv, kv], h),
        "self_attn.o_proj": ([h], q),
        "mlp.gate_up_proj": ([cfg.intermediate_size, cfg.intermediate_size], h),
        "mlp.down_proj": ([h], cfg.intermediate_size),
        "lm_head": ([cfg.vocab_size], h),
        "embed_tokens": ([h], cfg.vocab_size),
    }


LLAMA_TP_PLAN = TPPlan(
    column=frozenset({"q_proj", "gate_proj", "up_proj", "w1", "w3"}),  # dense, shared and routed experts
    kv=frozenset({"k_proj", "v_proj"}),
    row=frozenset({"o_proj", "down_proj", "w2"}),
    vocab=frozenset({"embed_tokens", "lm_head"}),
    fused=MappingProxyType({"qkv_proj": ("q", "kv", "kv"), "gate_up_proj": ("half", "half")}),  # Phi-3's
)
LLAMA_LORA_TARGETS = LoRATargets(
    layer_modules=MappingProxyType(
        {
            "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "self_attn.o_proj": ("o_proj",),
            "mlp.gate_up_proj": ("gate_proj", "up_proj"),
            "mlp.down_proj": ("down_proj",),
        }
    ),
    shapes=lora_shapes,
)


class OtherStage(nn.Module):
    """A part of the model another pipeline stage holds: no parameters here, never called."""


class LlamaForCausalLM(nn.Module):
    """The Llama family. Weights use HF names except fused qkv_proj / gate_up_proj (see load_weights)."""

    cos_sin_cache: torch.Tensor
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer  # a family with other layers names its own
    packed_modules_mapping = PACKED_MODULES
    tp_plan: TPPlan | None = LLAMA_TP_PLAN
    lora_targets: LoRATargets | None = LLAMA_LORA_TARGETS

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
    ) -> None:
        """``tp``: this rank's tensor-parallel group; the layers then hold its shard (``shard_config``).
        ``pp``: this rank's pipeline stage; only its layers (and the embedding on the first stage, the
        final norm and LM head on the last) exist here, the others are ``OtherStage`` placeholders."""
        super().__init__()
        self.tp, self.pp, self.vocab_size = tp, pp, cfg.vocab_size
        cfg = shard_config(cfg, tp) if tp is not None else cfg
        self.cfg = cfg
        self.vocab_start = tp.vocab_rows(self.vocab_size)[0] if tp is not None else 0
        first, last = pp is None or pp.is_first, pp is None or pp.is_last
        owned = stage_layers(cfg.num_hidden_layers, pp)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first else OtherStage()
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, i, tp, i - owned.start) if i in owned else OtherStage()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else OtherStage()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last else OtherStage()
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", self.build_rope_cache(dtype), persistent=False)

    def build_rope_cache(self, dtype: torch.dtype) -> torch.Tensor:
        return rope_cache(self.cfg, self.max_positions, dtype)

    def rope_tables(self) -> tuple[torch.Tensor, ...]:
        """The rotary tables the layers use (one here; a family with per-layer bases has more)."""
        return (self.cos_sin_cache,)

    def rope_of(self, layer: int) -> int:
        """Which of ``rope_tables`` decoder layer ``layer`` rotates with."""
        return 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: Backend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds``: the step's input embeddings when they are not only tokens' (images).
        A pipeline stage before the last returns its hidden states after sending them on."""
        pp, residual = self.pp, None
        if pp is not None and not pp.is_first:
            like = self.cos_sin_cache  # the model's dtype and device (a norm weight may be kept in fp32)
            x, residual = pp.recv_hidden(input_ids.shape[0], self.cfg.hidden_size, like.dtype, like.device)
        else:
            x = self.embed_ids(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = [backend.rope_inputs(positions, table) for table in self.rope_tables()]
        for i in stage_layers(len(self.layers), pp):
            rope = ropes[self.rope_of(i)]
            x, residual = self.layers[i](x, residual, rope, kv_cache, meta, backend)
        if pp is not None and not pp.is_last:
            assert residual is not None  # every stage holds a layer
            pp.send_hidden(x, residual)
            return x
        return self.norm(x, backend, residual)[0]

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocab-parallel: each rank embeds the ids in its rows, the sum is the lookup."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.cfg.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits over the whole vocabulary, fp32 unless ``fp32=False`` (vocab-parallel: every rank gathers
        every shard, so each samples the same tokens from the same logits; pipeline stages get the last
        stage's, in fp32)."""
        if self.pp is not None and not self.pp.is_last:
            return self.pp.share_logits(None, hidden.shape[0], self.vocab_size, hidden.device)
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, : self.vocab_size]
        if self.pp is not None:
            return self.pp.share_logits(logits.float(), hidden.shape[0], self.vocab_size, hidden.device)
        return logits.float() if fp32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up; every parameter must be filled."""
        if self.pp is not None:
            weights = ((n, t) for n, t in weights if self.pp.reads(n))
        load_llama_weights(self, weights, self.cfg, staged=self.pp is not None)


def load_llama_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    optional: tuple[str, ...] = (),
    staged: bool = False,
) -> None:
    """Copy HF-named tensors into ``module`` (q/k/v and gate/up fused); every parameter not in ``optional``
    must be filled (ValueError naming the missing ones). Under tensor parallelism the tensors arrive as
    the rank's slices (the loader's TPShard) and ``cfg`` is the rank's shard config. ``staged``: a pipeline stage, which skips the tensors of
    the embedding, final norm and LM head that another stage holds."""
    params = dict(module.named_parameters())
    filled = dict.fromkeys(params, 0)  # elements copied into each parameter
    for name, tensor in weights:
        name = moe_name(name.removeprefix("model."))
        if (expert := expert_shard(name, cfg)) is not None:
            param_name, index, (lo, hi) = expert
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            _copy_into(params[param_name].data[index, lo:hi], tensor, f"expert {index}")
            filled[param_name] += tensor.numel()
            continue
        target, shard = _map_name(name, cfg)
        if target is None:
            continue
        tied_head = target == "embed_tokens.weight" and cfg.tie_word_embeddings and "lm_head.weight" in params
        if target not in params and not (staged and "layers." not in target):
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
        if target in params:
            _copy_shard(params[target], tensor, shard, cfg)
            filled[target] += tensor.numel()
        if tied_head:
            _copy_shard(params["lm_head.weight"], tensor, None, cfg)
            filled["lm_head.weight"] += tensor.numel()
    missing = [n for n, p in params.items() if n not in optional and filled[n] < p.numel()]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}")


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_name(name: str, cfg: ModelConfig) -> tuple[str | None, str | None]:
    if "rotary_emb" in name:
        return None, None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: str | None, cfg: ModelConfig) -> None:
    if shard is None:
        rows = (0, param.shape[0])
    else:
        q, kv, half = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            param.shape[0] // 2,  # gate_up: a shared expert's width is not intermediate_size
        )
        rows = {
            "q": (0, q),
            "k": (q, q + kv),
            "v": (q + kv, q + 2 * kv),
            "gate": (0, half),
            "up": (half, 2 * half),
        }[shard]
    _copy_into(param.data[rows[0] : rows[1]], tensor, shard or "tensor")


def _copy_into(dst: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(
            f"weight shape mismatch for {what}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
        )
    dst.copy_(tensor.to(dst.dtype))
