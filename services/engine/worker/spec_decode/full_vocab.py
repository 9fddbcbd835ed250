"""FullVocab: a tensor-parallel target's token embedding and LM head, whole, for an EAGLE head on rank 0.

The target's own are vocabulary shards joined by collectives every rank must enter; the proposer runs on
rank 0 alone, so it reads these unsharded copies instead (read from the checkpoint: 2 x vocab x hidden)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from services.engine.worker.loader.model_loader import dense_checkpoint_tensors
from services.engine.worker.model_config import ModelConfig


def _wanted(name: str) -> bool:
    return name.endswith("embed_tokens.weight") or name == "lm_head.weight"


class FullVocab(nn.Module):
    """``embed_tokens`` and ``compute_logits`` over the whole vocabulary."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.head = head

    @classmethod
    def load(cls, path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> FullVocab:
        """The checkpoint's embedding and LM head (a tied model's head is its embedding)."""
        found = dict(dense_checkpoint_tensors(Path(path), _wanted))
        embed = next((t for n, t in found.items() if n.endswith("embed_tokens.weight")), None)
        head = found.get("lm_head.weight", embed if cfg.tie_word_embeddings else None)
        if embed is None or head is None:
            raise ValueError(f"speculative_config: {path} has no token embedding and LM head for EAGLE")
        return cls(embed.to(device, dtype), head.to(device, dtype))

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = hidden @ self.head.t()
        return logits.float() if fp32 else logits
