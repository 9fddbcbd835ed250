"""TPShard: the slice of each checkpoint tensor one tensor-parallel rank loads (Megatron-style layout).

Column-parallel (output rows split): q/k/v, gate/up (dense, shared and routed experts), and the
vocabulary rows of the embedding and LM head. Row-parallel (input columns split, partial sums
all-reduced): o_proj and down_proj, whose bias only rank 0 keeps. KV heads fewer than the ranks are
replicated (each rank takes the head its query heads use). Norms and the MoE router are replicated.
"""

from __future__ import annotations

import torch

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.parallel.tp_group import TPGroup

_COLUMN = frozenset({"q_proj", "gate_proj", "up_proj", "w1", "w3"})
_ROW = frozenset({"o_proj", "down_proj", "w2"})
_VOCAB = frozenset({"embed_tokens", "lm_head"})


class TPShard:
    """Slices HF-named tensors (``model.`` prefix removed) for one rank of ``tp``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        self.cfg, self.tp = cfg, tp

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        parts = name.split(".")
        leaf, kind = (parts[-2], parts[-1]) if len(parts) > 1 else (parts[0], "")
        if leaf in _COLUMN:
            return self._rows(tensor)
        if leaf in ("k_proj", "v_proj"):
            return self._kv(tensor)
        if leaf == "qkv_proj":  # Phi-3's fused [q; k; v]
            q, kv = (
                self.cfg.num_attention_heads * self.cfg.head_dim,
                self.cfg.num_key_value_heads * self.cfg.head_dim,
            )
            q_part, k_part, v_part = tensor.split([q, kv, kv])
            return torch.cat([self._rows(q_part), self._kv(k_part), self._kv(v_part)])
        if leaf == "gate_up_proj":  # Phi-3's fused [gate; up]
            return torch.cat([self._rows(half) for half in tensor.chunk(2)])
        if leaf in _ROW:
            if kind == "bias":  # added once, by rank 0, to the all-reduced sum
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            return self._columns(tensor)
        if leaf in _VOCAB:
            return self._vocab(tensor)
        return tensor

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // self.tp.size
        return t[self.tp.rank * n : (self.tp.rank + 1) * n]

    def _columns(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // self.tp.size
        return t[:, self.tp.rank * n : (self.tp.rank + 1) * n]

    def _kv(self, t: torch.Tensor) -> torch.Tensor:
        first, count = self.tp.kv_head(self.cfg.num_key_value_heads)
        d = self.cfg.head_dim
        return t[first * d : (first + count) * d]

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        start, rows = self.tp.vocab_rows(t.shape[0])
        part = t[start : start + rows]
        if part.shape[0] < rows:  # the last rank's padding rows: zero embeddings, logits cut off
            part = torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))])
        return part
