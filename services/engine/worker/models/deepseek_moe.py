"""DeepseekMoE: DeepSeek-V3's routed experts behind a grouped top-k router (``noaux_tc``), plus its
always-on shared experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import LlamaMLP
from services.engine.worker.models.moe import ExpertCounted, MoEBlock
from services.engine.worker.parallel.tp_group import TPGroup


class GroupedTopKRouter(nn.Module):
    """The router's [E, H] weight (and V3's [E] ``e_score_correction_bias``), held in fp32 whatever the
    model's dtype (as HF keeps them); not an nn.Linear, so no packer or quantizer touches it."""

    e_score_correction_bias: nn.Parameter | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError("GroupedTopKRouter: the config declares no n_group / topk_group")
        e = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size), requires_grad=False)
        bias = nn.Parameter(torch.empty(e), requires_grad=False) if mla.topk_method == "noaux_tc" else None
        self.e_score_correction_bias = bias
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.groups, self.topk_group, self.scaling = mla.n_group, mla.topk_group, mla.routed_scaling_factor
        self.method = mla.topk_method

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GroupedTopKRouter:
        super()._apply(fn, recurse)  # .to(dtype) / .to(device) / to_empty, then back to fp32
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        if self.e_score_correction_bias is not None:
            bias = self.e_score_correction_bias.detach().float()
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, K], times ``routed_scaling_factor``. ``noaux_tc`` (V3): the biased
        sigmoid scores choose the ``topk_group`` best groups (a group's score: its two best experts), then
        the top-k experts in them; the unbiased scores weight them (renormalised if ``norm_topk_prob``).
        ``greedy`` / ``group_limited_greedy`` (V2): softmax scores, the top-k (of the groups whose best
        expert is among the ``topk_group`` best), weighted by their scores."""
        logits = F.linear(x.float(), self.weight)
        if self.e_score_correction_bias is None:
            scores = torch.softmax(logits, dim=-1)
            if self.method == "group_limited_greedy":
                scores = self._keep_groups(scores, lambda g: g.max(dim=-1).values, 0.0)
            weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
            return weights * self.scaling, ids
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        choice = self._keep_groups(choice, lambda g: g.topk(2, dim=-1).values.sum(dim=-1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _keep_groups(
        self,
        values: torch.Tensor,
        group_score: Callable[[torch.Tensor], torch.Tensor],
        fill: float,
    ) -> torch.Tensor:
        """``values`` with the experts outside its ``topk_group`` best groups set to ``fill``."""
        t, e = values.shape
        grouped = values.view(t, self.groups, e // self.groups)
        scores = group_score(grouped)
        best = scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
        return values.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), fill)


class DeepseekMoE(ExpertCounted):
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` run by the backend's fused MoE op;
    ``shared_experts`` (n_shared_experts times moe_intermediate_size wide) added for every token. Under
    ``--quantization int8`` the experts become int8 codes with a scale per (expert, row), as MoEBlock's."""

    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    tp: TPGroup | None = None  # not sharded (MoEBlock's quantize_int8 reads it)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.num_experts)
        mla = cfg.mla
        if mla is None:
            raise ValueError("DeepseekMoE: the config declares no MLA / grouped-routing facts")
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = GroupedTopKRouter(cfg)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        shared = i * mla.n_shared_experts
        self.shared_experts = LlamaMLP(cfg, shared) if shared else None
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)

    def quantize_int8(self) -> None:
        """The experts as int8 codes with a scale per (expert, output row) (MoEBlock's quantizer)."""
        MoEBlock.quantize_int8(self)  # type: ignore[arg-type]  # the same w13 / w2 / scale attributes

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        weights, ids = self.gate(x)
        self.count(ids)
        out = backend.fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, backend)
        return out
