"""TPShard: the slice of each checkpoint tensor one tensor-parallel rank reads (Megatron-style layout).

Column-parallel (output rows split): q/k/v, gate/up (dense, shared and routed experts), and the
vocabulary rows of the embedding and LM head. Row-parallel (input columns split, partial sums
all-reduced): o_proj and down_proj, whose bias only rank 0 keeps. KV heads fewer than the ranks are
replicated (each rank takes the head its query heads use). Norms and the MoE router are replicated.

The source is a whole tensor or a lazy safetensors slice (``safe_open(...).get_slice(name)``): both
index as ``src[a:b]`` / ``src[:, a:b]``, so a rank reading a safetensors file reads only its bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.parallel.tp_group import TPGroup

_COLUMN = frozenset({"q_proj", "gate_proj", "up_proj", "w1", "w3"})
_ROW = frozenset({"o_proj", "down_proj", "w2"})
_VOCAB = frozenset({"embed_tokens", "lm_head"})


def _shape(src: Any) -> list[int]:
    return list(src.shape) if isinstance(src, torch.Tensor) else list(src.get_shape())


class TPShard:
    """Reads HF-named tensors (any prefix) for one rank of ``tp``; ``cfg`` is the whole model's config."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        self.cfg, self.tp = cfg, tp

    def __call__(self, name: str, src: Any) -> torch.Tensor:
        """This rank's part of tensor ``name`` from ``src`` (a tensor or a safetensors slice)."""
        parts = name.split(".")
        leaf, kind = (parts[-2], parts[-1]) if len(parts) > 1 else (parts[0], "")
        shape = _shape(src)
        if leaf in _ROW:
            if kind == "bias":  # added once, by rank 0, to the all-reduced sum
                bias = src[:]
                return bias if self.tp.rank == 0 else torch.zeros_like(bias)
            n = shape[1] // self.tp.size
            return src[:, self.tp.rank * n : (self.tp.rank + 1) * n]
        if leaf in _VOCAB:
            return self._vocab(src, shape[0])
        ranges = self._row_ranges(leaf, shape[0])
        if ranges is None:
            return src[:]
        pieces = [src[a:b] for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _row_ranges(self, leaf: str, rows: int) -> list[tuple[int, int]] | None:
        """The [start, end) row ranges of a column-parallel tensor, in order (None: replicated)."""
        if leaf in _COLUMN:
            return [self._split(0, rows)]
        if leaf in ("k_proj", "v_proj"):
            return [self._kv(0)]
        if leaf == "qkv_proj":  # Phi-3's fused [q; k; v]
            q = self.cfg.num_attention_heads * self.cfg.head_dim
            kv = self.cfg.num_key_value_heads * self.cfg.head_dim
            return [self._split(0, q), self._kv(q), self._kv(q + kv)]
        if leaf == "gate_up_proj":  # Phi-3's fused [gate; up]
            half = rows // 2
            return [self._split(0, half), self._split(half, half)]
        return None

    def _split(self, start: int, rows: int) -> tuple[int, int]:
        n = rows // self.tp.size
        return start + self.tp.rank * n, start + (self.tp.rank + 1) * n

    def _kv(self, start: int) -> tuple[int, int]:
        first, count = self.tp.kv_head(self.cfg.num_key_value_heads)
        d = self.cfg.head_dim
        return start + first * d, start + (first + count) * d

    def _vocab(self, src: Any, vocab: int) -> torch.Tensor:
        start, rows = self.tp.vocab_rows(vocab)
        start = min(start, vocab)
        part = src[start : min(start + rows, vocab)]
        if part.shape[0] < rows:  # the last rank's padding rows: zero embeddings, logits cut off
            part = torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))])
        return part
