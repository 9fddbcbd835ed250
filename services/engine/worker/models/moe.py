"""MoEBlock: a mixture-of-experts MLP (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE).

Routing: router logits in fp32, softmax over the experts, top-k, renormalised to sum to 1 where the
config says so (always for Mixtral, ``norm_topk_prob`` for Qwen). Experts are stacked ``w13 [E, 2I, H]``
(gate rows, then up rows) and ``w2 [E, H, I]`` for the backend's fused MoE op. Tokens routed to each
expert are counted (``expert_tokens``) so that load skew is observable.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.quantization.int8_rows import Int8Rows

# HF expert tensor names -> (w13 | w2, which rows): Mixtral's w1/w3/w2, Qwen's gate/up/down_proj
_EXPERT = re.compile(
    r"^(?P<prefix>.*)\.(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$"
)
_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class RouterGate(nn.Module):
    """The router's [E, H] weight, held in fp32 whatever the model's dtype (converted once, not per step);
    not an nn.Linear, so no packer or quantizer touches it."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RouterGate:
        super()._apply(fn, recurse)  # .to(dtype) / .to(device) / to_empty, then back to fp32
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        return self


class ExpertCounted(nn.Module):
    """A routed-experts module: counts the tokens each expert gets (``expert_tokens``, for /metrics); the
    engine finds its MoE layers by this class (and keeps CUDA graphs off for them: routing syncs)."""

    expert_tokens: torch.Tensor

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def count(self, ids: torch.Tensor) -> None:
        """Add one step's routing (expert ids [T, K])."""
        self.expert_tokens += torch.bincount(ids.reshape(-1), minlength=self.expert_tokens.shape[0])


class MoEBlock(ExpertCounted):
    """``forward(x)`` -> routed experts (+ the gated shared expert where there is one)."""

    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, shared_mlp: nn.Module | None, tp: TPGroup | None = None) -> None:
        """``tp``: the experts hold this rank's shard (w13 its rows, w2 its input columns)."""
        super().__init__(cfg.num_experts)
        self.tp = tp
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = RouterGate(e, h)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.shared_expert = shared_mlp
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared_mlp is not None else None
        self.register_buffer("w13_scale", None, persistent=False)  # int8 experts: a scale per (expert, row)
        self.register_buffer("w2_scale", None, persistent=False)

    def quantize_int8(self) -> None:
        """Hold the experts as int8 codes with a scale per (expert, output row), in place of the floats
        (under tensor parallelism w2's rows span the ranks: their scales come from the whole rows)."""
        for name in ("w13", "w2"):
            weight = getattr(self, name)
            absmax = weight.data.float().abs().amax(dim=-1)
            if name == "w2" and self.tp is not None:
                absmax = self.tp.all_reduce_max(absmax)
            rows = Int8Rows.quantize(weight.data, absmax)
            codes, scale = rows.codes, rows.scales
            delattr(self, name)
            self.register_buffer(name, codes, persistent=False)
            setattr(self, f"{name}_scale", scale.to(weight.dtype))

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.count(ids)
        out = backend.fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, backend)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


def expert_shard(name: str, cfg: ModelConfig) -> tuple[str, int, tuple[int, int]] | None:
    """An HF per-expert tensor -> (our parameter, expert index, row range in it); None for other tensors."""
    m = _EXPERT.match(name)
    if m is None or m["proj"] not in _PARTS:
        return None
    i, part = cfg.moe_intermediate_size, _PARTS[m["proj"]]
    if part == "down":
        return f"{m['prefix']}.mlp.w2", int(m["e"]), (0, cfg.hidden_size)
    rows = (0, i) if part == "gate" else (i, 2 * i)
    return f"{m['prefix']}.mlp.w13", int(m["e"]), rows


def moe_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe.*`` under our ``mlp.*`` (the router: ``mlp.gate.weight``)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def moe_layers(model: nn.Module) -> list[tuple[int, ExpertCounted]]:
    """(decoder layer index, its MoE block) for every MoE layer of ``model`` (found once, after load).

    Their counters start at zero here: the loader materialises buffers without their initial values."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, ExpertCounted):
            module.expert_tokens.zero_()
            out.append((next((int(p) for p in name.split(".") if p.isdigit()), -1), module))
    return out


def expert_token_counts(layers: list[tuple[int, ExpertCounted]]) -> list[tuple[int, list[int]]]:
    """(MoE layer index, tokens routed to each expert since start) for each of ``layers``."""
    return [(layer, [int(n) for n in block.expert_tokens.tolist()]) for layer, block in layers]
