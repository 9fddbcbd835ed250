"""GptOssForCausalLM (text): the Llama machinery with gpt-oss's differences: q/k/v/o biases and a learned
attention sink per query head, alternating sliding / full layers (``layer_types``), YaRN rotary, and a
mixture of experts with a biased router (softmax over the top-k logits only), experts with biases, gate
and up rows interleaved, and a clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.grouped_moe import by_expert
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, OtherStage, RMSNorm
from services.engine.worker.models.moe import ExpertCounted
from services.engine.worker.parallel.pp_stage import PPStage
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.quantization.mxfp4 import BLOCK, dequantize_mxfp4


class GptOssRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: an fp32 weight (HF keeps these norms in fp32) times the fp32-normalised input,
    rounded to the input's dtype once, after the product (Llama's norm rounds before it); the residual
    add is rounded to the model's dtype first, as HF adds it."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GptOssRMSNorm:
        super()._apply(fn, recurse)  # .to(dtype) / .to(device) / to_empty, then back to fp32
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        return self

    def forward(
        self, x: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype), x


class GptOssRouter(nn.Module):
    """The router's [E, H] weight and [E] bias (not an nn.Linear: no packer or quantizer touches it)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


def _frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GptOssMoE(ExpertCounted):
    """Routed experts. ``w13 [E, 2I, H]`` keeps the checkpoint's interleaved rows (2j: gate j, 2j + 1: up
    j) with bias ``b13 [E, 2I]``; ``w2 [E, H, I]`` with bias ``b2 [E, H]``. MXFP4 checkpoints: the same
    rows as uint8 blocks ``w13_blocks [E, 2I, H/32, 16]`` and scales ``w13_scales [E, 2I, H/32]`` (w2's
    likewise), kept packed and decoded one expert at a time as it runs. Tokens are sorted by expert once
    and each expert with tokens runs its two matmuls over its rows (as grouped_moe does)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.num_experts)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if cfg.swiglu_limit is None:
            raise ValueError("swiglu_limit: gpt-oss's experts need the clamp limit of their SwiGLU")
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.router = GptOssRouter(e, h)
        self.packed = cfg.mxfp4_experts
        if self.packed:
            if h % BLOCK or i % BLOCK:
                raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size multiples of {BLOCK}")
            self.w13_blocks = _frozen(e, 2 * i, h // BLOCK, BLOCK // 2, dtype=torch.uint8)
            self.w13_scales = _frozen(e, 2 * i, h // BLOCK, dtype=torch.uint8)
            self.w2_blocks = _frozen(e, h, i // BLOCK, BLOCK // 2, dtype=torch.uint8)
            self.w2_scales = _frozen(e, h, i // BLOCK, dtype=torch.uint8)
        else:
            self.w13, self.w2 = _frozen(e, 2 * i, h), _frozen(e, h, i)
        self.b13, self.b2 = _frozen(e, 2 * i), _frozen(e, h)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, K]: the top-k router logits and their softmax (in x's dtype, as HF)."""
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved gate / up columns [n, 2I] -> [n, I]."""
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s (w13 [2I, H], w2 [H, I]) as float matrices (decoded from MXFP4 if packed)."""
        if not self.packed:
            return self.w13[expert], self.w2[expert]
        dtype = self.b13.dtype
        return (
            dequantize_mxfp4(self.w13_blocks[expert], self.w13_scales[expert], dtype),
            dequantize_mxfp4(self.w2_blocks[expert], self.w2_scales[expert], dtype),
        )

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        weights, ids = self.route(x)
        self.count(ids)
        flat_weights = weights.reshape(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert, tokens, rows in by_expert(ids, self.num_experts):
            w13, w2 = self.expert_weights(expert)
            h = self.activation(F.linear(x.index_select(0, tokens), w13, self.b13[expert]))
            down = F.linear(h, w2, self.b2[expert]) * flat_weights.index_select(0, rows).unsqueeze(1)
            out.index_add_(0, tokens, down.float())
        return out.to(x.dtype)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its attention takes the biases and sinks from the config) with gpt-oss's norms and
    experts."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None = None, cache_idx: int | None = None
    ) -> None:
        super().__init__(cfg, layer_idx, tp, cache_idx)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup | None) -> nn.Module:
        return GptOssMoE(cfg)


# HF expert tensors -> (our parameter, whether it is stored transposed: HF's float experts are x @ W
# layouts, its MXFP4 blocks and scales are already [E, out, in / 32, ...])
_EXPERTS = {
    "mlp.experts.gate_up_proj": ("mlp.w13", True),
    "mlp.experts.gate_up_proj_bias": ("mlp.b13", False),
    "mlp.experts.gate_up_proj_blocks": ("mlp.w13_blocks", False),
    "mlp.experts.gate_up_proj_scales": ("mlp.w13_scales", False),
    "mlp.experts.down_proj": ("mlp.w2", True),
    "mlp.experts.down_proj_bias": ("mlp.b2", False),
    "mlp.experts.down_proj_blocks": ("mlp.w2_blocks", False),
    "mlp.experts.down_proj_scales": ("mlp.w2_scales", False),
}


def _expert_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's stacked expert tensors under our names, [E, in, out] turned into [E, out, in]."""
    for name, tensor in weights:
        for hf, (ours, transposed) in _EXPERTS.items():
            if name.endswith("." + hf):
                name = name[: -len(hf)] + ours
                tensor = tensor.transpose(1, 2) if transposed else tensor
                break
        yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's embedding, stages, logits and loader, with gpt-oss's layers (no tensor parallelism or LoRA
    declared: the sinks and the expert tensors have no shard plan yet)."""

    decoder_layer = GptOssDecoderLayer
    tp_plan = None
    lora_targets = None

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
    ) -> None:
        if cfg.num_experts <= 0 or not cfg.attention_sinks:
            raise ValueError("GptOssForCausalLM: the config declares no num_local_experts / sinks")
        super().__init__(cfg, max_positions, dtype, tp, pp)
        if not isinstance(self.norm, OtherStage):
            self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_expert_names(weights))
