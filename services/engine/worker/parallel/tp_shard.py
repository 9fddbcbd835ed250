"""TPShard: the slice of each checkpoint tensor one tensor-parallel rank reads (Megatron-style layout).

Which tensors are column-parallel (output rows split), row-parallel (input columns split, partial sums
all-reduced, the bias kept by rank 0) or vocabulary-parallel is the model class's declared ``TPPlan``
(for the Llama family: q/k/v, gate/up; o_proj, down_proj; the embedding and LM head). KV heads fewer than
the ranks are replicated (each rank takes the head its query heads use). The rest is replicated.

The source is a whole tensor, a lazy safetensors slice (``safe_open(...).get_slice(name)``) or a whole
layer's quantized codes (GroupQuantWeight, Int8Rows: cut after quantizing, so every rank holds the codes and
scales the unsharded layer has): all index as ``src[a:b]`` / ``src[:, a:b]``, so a rank reading a
safetensors file reads only its bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.capabilities import TPPlan
from services.engine.worker.parallel.tp_group import TPGroup


def _shape(src: Any) -> list[int]:
    return list(src.get_shape()) if hasattr(src, "get_shape") else list(src.shape)


def _cat(pieces: list[Any]) -> Any:
    """Row blocks stacked: tensors, or quantized codes (GroupQuantWeight, Int8Rows: their ``cat_rows``)."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if isinstance(pieces[0], torch.Tensor) else type(pieces[0]).cat_rows(pieces)


def _pad_rows(part: Any, rows: int) -> Any:
    """Zero rows appended up to ``rows``."""
    if part.shape[0] >= rows:
        return part
    if isinstance(part, torch.Tensor):
        return torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))])
    return part.pad_rows(rows)


class TPShard:
    """Reads HF-named tensors (any prefix) for one rank of ``tp``; ``cfg`` is the whole model's config."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, plan: TPPlan) -> None:
        self.cfg, self.tp, self.plan = cfg, tp, plan

    def __call__(self, name: str, src: Any) -> Any:
        """This rank's part of tensor ``name`` from ``src`` (a tensor, a safetensors slice or codes)."""
        if any(mark in name for mark in self.plan.replicated):
            return src[:]
        parts = name.split(".")
        leaf, kind = (parts[-2], parts[-1]) if len(parts) > 1 else (parts[0], "")
        shape = _shape(src)
        if leaf in self.plan.row:
            if kind == "bias":  # added once, by rank 0, to the all-reduced sum
                bias = src[:]
                return bias if self.tp.rank == 0 else torch.zeros_like(bias)
            n = shape[1] // self.tp.size
            return src[:, self.tp.rank * n : (self.tp.rank + 1) * n]
        if leaf in self.plan.vocab:
            return self._vocab(src, shape[0])
        ranges = self._row_ranges(leaf, shape[0])
        if ranges is None:
            return src[:]
        return _cat([src[a:b] for a, b in ranges])

    def _row_ranges(self, leaf: str, rows: int) -> list[tuple[int, int]] | None:
        """The [start, end) row ranges of a column-parallel tensor, in order (None: replicated)."""
        plan = self.plan
        if leaf in plan.column:
            return [self._split(0, rows)]
        if leaf in plan.kv:
            return [self._kv(0)]
        if leaf not in plan.fused:
            return None
        sizes = {
            "q": self.cfg.num_attention_heads * self.cfg.head_dim,
            "kv": self.cfg.num_key_value_heads * self.cfg.head_dim,
            "half": rows // 2,
        }
        ranges, start = [], 0
        for part in plan.fused[leaf]:  # e.g. Phi-3's [q; k; v] and [gate; up]
            ranges.append(self._kv(start) if part == "kv" else self._split(start, sizes[part]))
            start += sizes[part]
        return ranges

    def _split(self, start: int, rows: int) -> tuple[int, int]:
        n = rows // self.tp.size
        return start + self.tp.rank * n, start + (self.tp.rank + 1) * n

    def _kv(self, start: int) -> tuple[int, int]:
        first, count = self.tp.kv_head(self.cfg.num_key_value_heads)
        d = self.cfg.head_dim
        return start + first * d, start + (first + count) * d

    def _vocab(self, src: Any, vocab: int) -> Any:
        start, rows = self.tp.vocab_rows(vocab)
        start = min(start, vocab)
        # the last rank's padding rows: zero embeddings, logits cut off
        return _pad_rows(src[start : min(start + rows, vocab)], rows)
