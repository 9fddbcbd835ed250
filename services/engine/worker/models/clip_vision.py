"""CLIPVisionTower: a CLIP ViT image encoder (patch embedding, class token, pre-norm encoder layers),
run up to the hidden state a LLaVA-style model feeds its projector."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.model_config import VisionTower


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name in ("gelu", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"vision hidden_act {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")


class CLIPLayer(nn.Module):
    """Pre-norm attention (biased q/k/v/out, no mask) and MLP, each with its residual."""

    def __init__(self, v: VisionTower) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads, self.act = v.num_attention_heads, v.hidden_act
        self.layer_norm1 = nn.LayerNorm(d, eps=v.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        self.layer_norm2 = nn.LayerNorm(d, eps=v.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(d, v.intermediate_size), nn.Linear(v.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.layer_norm1(x)
        q, k, val = (
            p(h).view(n, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        attn = F.scaled_dot_product_attention(q, k, val).transpose(1, 2).reshape(n, t, d)
        x = x + self.out_proj(attn)
        return x + self.fc2(_act(self.act, self.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """pixels [N, C, H, W] -> the chosen hidden state [N, patches (+1), D] (HF CLIPVisionModel's)."""

    def __init__(self, v: VisionTower) -> None:
        super().__init__()
        self.v = v
        d, patches = v.hidden_size, (v.image_size // v.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(v.num_channels, d, v.patch_size, v.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.position_embedding = nn.Embedding(patches + 1, d)
        self.pre_layrnorm = nn.LayerNorm(d, eps=v.layer_norm_eps)
        # hidden state i is the output of layer i (0: the embeddings): only the layers up to it are run
        depth = v.feature_layer % (v.num_hidden_layers + 1)
        self.layers = nn.ModuleList(CLIPLayer(v) for _ in range(depth))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embedding.weight[None]
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.v.select_strategy == "full" else x[:, 1:]
