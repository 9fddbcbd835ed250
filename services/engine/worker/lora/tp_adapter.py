"""shard_adapter: one tensor-parallel rank's part of a LoRA adapter, cut as its base layers are cut.

Column-parallel layers (q/k/v, gate/up, the LM head's vocabulary rows) keep A whole and take their output
columns of B; row-parallel layers (o_proj, down_proj) take their input columns of A and keep B whole: the
rank's partial ``(x_r A_r^T) B^T`` joins the base layer's partial sum before the all-reduce. The
embedding's A is indexed by token id: each rank keeps its vocabulary rows (the model zeroes the others).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.engine.worker.lora.peft_adapter import LoRAAdapter, LoRALayerWeights
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.parallel.tp_group import TPGroup

Ranges = list[tuple[int, int]]


def _cols(t: torch.Tensor, ranges: Ranges, width: int | None = None) -> torch.Tensor:
    """The columns ``ranges`` of ``t`` side by side (zero columns appended up to ``width``)."""
    part = torch.cat([t[:, a:b] for a, b in ranges], dim=1)
    if width is not None and part.shape[1] < width:
        part = torch.cat([part, part.new_zeros(part.shape[0], width - part.shape[1])], dim=1)
    return part


class AdapterShard:
    """Cuts adapters for rank ``tp.rank`` of a model whose whole config is ``cfg``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        self.cfg, self.tp = cfg, tp

    def __call__(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's part of every module of ``adapter``."""
        return replace(adapter, layers={p: self._module(p, w) for p, w in adapter.layers.items()})

    def _module(self, path: str, w: LoRALayerWeights) -> LoRALayerWeights:
        leaf = path.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj"):
            return LoRALayerWeights(_cols(w.a, [self._split(0, w.a.shape[1])]), w.b)
        if leaf == "qkv_proj":
            q = self.cfg.num_attention_heads * self.cfg.head_dim
            kv = self.cfg.num_key_value_heads * self.cfg.head_dim
            return LoRALayerWeights(w.a, _cols(w.b, [self._split(0, q), self._kv(q), self._kv(q + kv)]))
        if leaf == "gate_up_proj":
            half = w.b.shape[1] // 2
            return LoRALayerWeights(w.a, _cols(w.b, [self._split(0, half), self._split(half, half)]))
        if leaf == "lm_head":
            return LoRALayerWeights(w.a, self._vocab(w.b))
        if leaf == "embed_tokens":
            return LoRALayerWeights(self._vocab(w.a), w.b)
        raise ValueError(f"LoRA adapter: no tensor-parallel layout for module {path}")

    def _split(self, start: int, cols: int) -> tuple[int, int]:
        n = cols // self.tp.size
        return start + self.tp.rank * n, start + (self.tp.rank + 1) * n

    def _kv(self, start: int) -> tuple[int, int]:
        first, count = self.tp.kv_head(self.cfg.num_key_value_heads)
        d = self.cfg.head_dim
        return start + first * d, start + (first + count) * d

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        start, rows = self.tp.vocab_rows(self.cfg.vocab_size)
        start = min(start, self.cfg.vocab_size)
        return _cols(t, [(start, min(start + rows, self.cfg.vocab_size))], rows)
