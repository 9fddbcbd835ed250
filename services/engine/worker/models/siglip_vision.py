"""SiglipVisionTower: Idefics3's SigLIP image encoder (biased patch embedding, positions bucketed to the
pre-trained grid for any whole-patch size, pre-norm encoder layers, a final layer norm)."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.worker.model_config import VisionTower
from services.engine.worker.models.clip_vision import CLIPLayer


class SiglipVisionTower(nn.Module):
    """pixels [N, C, H, W] (H, W whole patches) -> the post-norm hidden states [N, patches, D]."""

    def __init__(self, v: VisionTower) -> None:
        super().__init__()
        d = v.hidden_size
        self.patch_size, self.side = v.patch_size, v.image_size // v.patch_size
        self.patch_embedding = nn.Conv2d(v.num_channels, d, v.patch_size, v.patch_size)
        self.position_embedding = nn.Embedding(self.side**2, d)
        self.layers = nn.ModuleList(CLIPLayer(v) for _ in range(v.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        rows, cols = pixels.shape[-2] // self.patch_size, pixels.shape[-1] // self.patch_size
        x = x + self.position_embedding(self.position_ids(rows, cols, pixels.device))[None]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each patch's fractional (row, col) bucketed onto the pre-trained side x side grid."""
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(n: int) -> torch.Tensor:
            step = 1.0 / torch.tensor(n, device=device)
            coords = torch.clamp(torch.arange(n, device=device, dtype=torch.float32) * step, max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(rows)[:, None] * self.side + buckets(cols)[None, :]).reshape(-1)
