"""QuantPlan: picks each linear layer's method and builds it from the checkpoint's (fused) shards at load."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight
from services.engine.worker.quantization.int8_rows import Int8Rows
from services.engine.worker.quantization.quant_config import QuantConfig
from services.engine.worker.quantization.quantized_linear import Int4Linear, Int8Embedding, Int8Linear
from services.engine.worker.quantization.triton_linear import TritonQuantLinear

Shard = torch.Tensor | GroupQuantWeight
Cut = Callable[[str, Any], Any]  # (tensor name, whole tensor or codes) -> this rank's part


def _whole(name: str, tensor: Any) -> Any:
    return tensor


@dataclass(frozen=True)
class SliceReading:
    """A tensor-parallel rank that reads only its slices of a float checkpoint and quantizes them: which
    layers are row-parallel (input columns cut), and the max over ranks that gives their int8 rows the
    scales of the whole rows, so the codes equal the whole layer's, cut."""

    row: frozenset[str]
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor]


class _Pending(nn.Module):
    """Stands in for a linear layer whose weight the plan collects (it has no parameters to fill)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = (
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
        )


class QuantPlan:
    """Quantized linears of one model: claimed out of the tensor stream, built by ``finish``.

    A model may declare ``packed_modules_mapping`` (fused module -> checkpoint shard names, in row
    order), e.g. ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``; other linears map one to one.
    """

    def __init__(
        self,
        model: nn.Module,
        qcfg: QuantConfig,
        dtype: torch.dtype,
        kernels: str = "cpu",
        shard: Cut | None = None,
        slices: SliceReading | None = None,
    ) -> None:
        """``shard``: a tensor-parallel rank's cut of each named tensor (the model holds its shard); a layer
        is quantized whole, then cut, so each rank holds the unsharded layer's codes and scales. With
        ``slices`` where every layer's codes can be made from the rank's slices alone (``reads_slices``),
        the stream already holds the rank's slices and nothing is cut here."""
        self.qcfg, self.dtype, self.kernels = qcfg, dtype, kernels  # kernels: "cpu" (torch's) | "triton"
        fused: dict[str, tuple[str, ...]] = getattr(model, "packed_modules_mapping", {})
        self.shard_index = {s: (f, i) for f, shards in fused.items() for i, s in enumerate(shards)}
        self.shard_count = {f: len(shards) for f, shards in fused.items()}
        self.tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
        self.pending: dict[str, _Pending] = {}
        for path, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and (qcfg.lm_head or path.split(".")[-1] != "lm_head"):
                self.pending[path] = _Pending(mod)
                _set_module(model, path, self.pending[path])
        self.weights: dict[str, dict[int, Shard]] = {p: {} for p in self.pending}
        self.names: dict[str, dict[int, str]] = {p: {} for p in self.pending}  # each shard's tensor name
        self.biases: dict[str, dict[int, torch.Tensor]] = {p: {} for p in self.pending}
        self.built: dict[str, nn.Module] = {}  # a layer is built as soon as its shards are in
        self.slices = slices if slices is not None and self._slices_suffice(slices) else None
        self.cut: Cut = _whole if self.slices is not None else (shard or _whole)

    @property
    def reads_slices(self) -> bool:
        """The loader hands this plan the rank's slices of a float checkpoint, not whole tensors."""
        return self.slices is not None

    def _slices_suffice(self, slices: SliceReading) -> bool:
        """int8 and int4 quantized at load on the CPU kernels: int8 rows take the whole rows' max from the
        other ranks, int4 groups are whole when each rank's input columns hold whole groups."""
        q = self.qcfg
        if not (q.at_load and q.method in ("int8", "int4") and self.kernels == "cpu"):
            return False
        if q.method == "int8":
            return True
        return q.group_size > 0 and all(
            p.in_features % q.group_size == 0 for path, p in self.pending.items() if _leaf(path) in slices.row
        )

    def filter(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass through what the model loads itself; keep the planned linears' weights and biases."""
        for name, tensor in tensors:
            if not self._claim(name.removeprefix("model."), tensor):
                yield name, self.cut(name, _dense(tensor))

    def _claim(self, name: str, tensor: Any) -> bool:
        module, _, part = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused, index = self.shard_index.get(leaf, (leaf, 0))
        path = f"{parent}.{fused}" if parent else fused
        if module == "embed_tokens" and self.tied and "lm_head" in self.pending and part == "weight":
            self.weights["lm_head"][0] = tensor
            self.names["lm_head"][0] = "lm_head.weight"
            self._build_if_complete("lm_head")
            return False  # the model loads its embedding too (replaced by a view of lm_head in finish)
        if path not in self.pending or part not in ("weight", "bias"):
            return False
        if part == "weight":
            self.weights[path][index] = tensor
            self.names[path][index] = name
        else:
            self.biases[path][index] = self.cut(name, tensor)
        self._build_if_complete(path)
        return True

    def _build_if_complete(self, path: str) -> None:
        """Quantize a layer once its last shard arrives, so float copies never pile up for the model."""
        want = self.shard_count.get(path.split(".")[-1], 1)
        pending = self.pending[path]
        if len(self.weights[path]) == want and (not pending.has_bias or len(self.biases[path]) == want):
            self.built[path] = self._build(path, pending)
            self.weights[path], self.biases[path] = {}, {}

    def finish(self, model: nn.Module) -> str:
        """Build every planned layer; says what was built."""
        kinds: Counter[str] = Counter()
        for path, pending in self.pending.items():
            # a layer not built yet is missing shards: _build raises, naming them
            layer = self.built.pop(path) if path in self.built else self._build(path, pending)
            _set_module(model, path, layer)
            kinds[type(layer).__name__] += 1
            if path == "lm_head" and self.tied and isinstance(layer, Int8Linear):
                model.embed_tokens = Int8Embedding(layer)
        if self.qcfg.at_load and self.qcfg.method in ("int8", "int4"):
            for mod in model.modules():  # MoE experts: int8 (per expert and row), also under int4
                quantize = getattr(mod, "quantize_int8", None)
                if quantize is not None:
                    quantize()
                    kinds["int8 experts"] += 1
        return ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items()))

    def _build(self, path: str, pending: _Pending) -> nn.Module:
        want = self.shard_count.get(path.split(".")[-1], 1)
        shards, biases = self.weights[path], self.biases[path]
        if len(shards) != want or (pending.has_bias and len(biases) != want):
            raise ValueError(f"checkpoint is missing weights of {path} ({len(shards)} of {want} shards)")
        whole = [shards[i] for i in range(want)]
        kind = self._method(path, whole)
        # per shard: every encoding is row by row, as the fused layer's
        codes = self._encode(kind, whole, path)
        parts = [self.cut(self.names[path][i], c) for i, c in enumerate(codes)]
        bias = torch.cat([biases[i].float() for i in range(want)]) if pending.has_bias else None
        rows = sum(p.shape[0] for p in parts)
        if rows != pending.out_features or any(p.shape[1] != pending.in_features for p in parts):
            raise ValueError(
                f"weight shape mismatch for {path}: expected ({pending.out_features}, {pending.in_features})"
            )
        if kind != "float" and self.kernels == "triton":
            return TritonQuantLinear(GroupQuantWeight.cat_rows(parts), bias, self.dtype)
        if kind == "int4":
            return Int4Linear(GroupQuantWeight.cat_rows(parts), bias, self.dtype)
        if kind in ("int8", "fp8"):  # the CPU has no FP8 matmul: FP8 weights run as int8 per row
            return Int8Linear(Int8Rows.cat_rows(parts), bias, self.dtype)
        linear = nn.Linear(pending.in_features, pending.out_features, bias=bias is not None, dtype=self.dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.cat(parts))
            if bias is not None:
                linear.bias.copy_(bias)
        return linear.requires_grad_(False)

    def _encode(self, kind: str, parts: list[Shard], path: str) -> list[Any]:
        """Each shard of a layer in the form its linear takes: floats, Int8Rows, or GroupQuantWeight."""
        if kind == "float":
            return [_dense(p) for p in parts]
        if self.kernels == "triton":
            return self._codes(kind, parts)
        if kind == "int4":
            return [
                p
                if isinstance(p, GroupQuantWeight)
                else GroupQuantWeight.quantize(p, 4, self.qcfg.group_size)
                for p in parts
            ]
        return [Int8Rows.quantize(_dense(p), self._row_absmax(path, p)) for p in parts]

    def _row_absmax(self, path: str, part: Shard) -> torch.Tensor | None:
        """The whole rows' absolute maxima of a row-parallel layer read as slices (None: the part's own)."""
        if self.slices is None or _leaf(path) not in self.slices.row:
            return None
        return self.slices.all_reduce_max(Int8Rows.row_absmax(_dense(part)))

    def _codes(self, kind: str, parts: list[Shard]) -> list[GroupQuantWeight]:
        """The layer's codes for the Triton kernel: stored codes when they fuse, else quantized floats."""
        coded = [p for p in parts if isinstance(p, GroupQuantWeight)]
        if len(coded) == len(parts) and _same_layout(parts) and coded[0].group % 16 == 0:
            return coded
        dense = [_dense(p) for p in parts]
        if kind == "fp8":
            return [GroupQuantWeight.quantize_fp8(d) for d in dense]
        bits = 4 if kind == "int4" else 8
        # int8: one scale per row
        return [
            GroupQuantWeight.quantize(d, bits, self.qcfg.group_size if bits == 4 else d.shape[1])
            for d in dense
        ]

    def _method(self, path: str, parts: list[Shard]) -> str:
        """int4 | int8 | fp8 | float for one layer.

        4-bit codes that fuse stay 4-bit; FP8 codes stay FP8; other quantized codes run as int8; float
        weights of a quantized checkpoint stay float. ``--quantization int4|int8|fp8`` quantizes float
        weights (int4 leaves lm_head at int8, as llama.cpp keeps its output layer at 6-8 bits).
        """
        coded = [p for p in parts if isinstance(p, GroupQuantWeight)]
        if coded and any(p.fmt == "e4m3" for p in coded):
            return "fp8"
        if self.qcfg.method == "fp8" and not coded:
            return "fp8"
        if coded and len(coded) == len(parts) and all(p.bits == 4 for p in coded) and _same_layout(parts):
            return "int4"
        if self.qcfg.method == "int4" and not coded and path != "lm_head":
            return "int4"
        if coded or self.qcfg.method in ("int4", "int8"):
            return "int8"
        return "float"


def dense_stream(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A quantized checkpoint read as float tensors (``--quantization none``)."""
    for name, tensor in tensors:
        yield name, _dense(tensor)


def _dense(t: Shard) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GroupQuantWeight) else t


def _same_layout(parts: list[Shard]) -> bool:
    first = parts[0]
    return isinstance(first, GroupQuantWeight) and all(
        isinstance(p, GroupQuantWeight) and first.same_layout(p) for p in parts
    )


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]
