"""LoRAManager: known adapters, a CPU cache of loaded ones (LRU) and the device slots a step's adapters use."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.engine.worker.lora.lora_layer import LoRAEmbedding, LoRALinear, LoRAStep
from services.engine.worker.lora.ops import select_ops
from services.engine.worker.lora.peft_adapter import LoRAAdapter
from services.engine.worker.lora.tp_adapter import AdapterShard
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.capabilities import LoRATargets
from services.engine.worker.parallel.tp_group import TPGroup, shard_config

if TYPE_CHECKING:
    from services.engine.worker.input_batch import CachedRequestState

log = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by name: registered (path), cached on CPU (``max_cpu_loras``, LRU), in ``max_loras`` slots.

    The scheduler never runs more distinct adapters in a step than there are slots, so ``prepare`` can
    always find one: a slot whose adapter this step does not use is evicted (least recently used first).
    ``backend``: the engine's compute backend name (``triton`` selects the Triton LoRA kernels).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        targets: LoRATargets,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device = torch.device("cpu"),
        backend: str = "torch",
        tp: TPGroup | None = None,
    ) -> None:
        self.ops = select_ops(device, backend)
        self.step = LoRAStep(self.ops, max_loras, device)
        self.max_rank, self.max_cpu_loras = max_rank, max(max_cpu_loras, max_loras)
        self.targets = targets
        self.shapes = targets.shapes(cfg)  # the whole model's: what an adapter file is checked against
        # under tensor parallelism: each adapter cut as this rank's base layers are
        self.cut = AdapterShard(cfg, tp) if tp is not None else None
        rank_shapes = targets.shapes(shard_config(cfg, tp)) if tp is not None else self.shapes
        self.layers: dict[str, LoRALinear | LoRAEmbedding] = {}
        decoder_layers: nn.ModuleList = getattr(model, "layers")  # noqa: B009 - the decoder models have it
        for i, layer in enumerate(decoder_layers):
            for path in targets.layer_modules:
                parent_name, leaf = path.split(".")
                parent = getattr(layer, parent_name)
                wrapped = LoRALinear(getattr(parent, leaf), rank_shapes[path][0], max_rank, dtype, self.step)
                setattr(parent, leaf, wrapped)
                self.layers[f"layers.{i}.{path}"] = wrapped
        (vocab,), hidden = rank_shapes["lm_head"][0], cfg.hidden_size
        head = LoRALinear(model.get_submodule("lm_head"), [vocab], max_rank, dtype, self.step, True, True)
        embed = LoRAEmbedding(model.get_submodule("embed_tokens"), vocab, hidden, max_rank, dtype, self.step)
        model.lm_head, model.embed_tokens = head, embed  # lm_head / embed_tokens: allocated on first use
        self.layers |= {"lm_head": head, "embed_tokens": embed}
        self.paths: dict[str, str] = {}
        self.retiring: dict[str, LoRAAdapter] = {}  # unloaded, kept while requests still run under them
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.loads = self.evictions = 0
        self.requests: Counter[str] = Counter()  # requests queued per adapter, since start

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def add(self, name: str, path: str) -> None:
        """Register and load an adapter (errors name the problem; a failed add changes nothing)."""
        if name in self.paths or name in self.retiring:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        self.paths[name] = path
        self._cache(adapter)

    def remove(self, name: str) -> None:
        """Unregister: new requests may not name it; the ones already queued or running finish under it."""
        if name not in self.paths:
            raise KeyError(name)
        self.retiring[name] = self._adapter(name)
        del self.paths[name]
        self.cpu.pop(name, None)

    def forget(self, in_use: set[str]) -> None:
        """Drop retiring adapters no request uses any more (and free their slots)."""
        for name in [n for n in self.retiring if n not in in_use]:
            del self.retiring[name]
            for slot, held in enumerate(self.slots):
                if held == name:
                    self._clear(slot)

    def prepare(
        self,
        req_ids: Sequence[str],
        states: Mapping[str, CachedRequestState],
        query_start_loc: torch.Tensor,
    ) -> None:
        """Slots for this step's adapters, and the step's plan (token rows per request from query_start_loc)."""
        lora_names = [states[r].lora_name for r in req_ids]
        starts = query_start_loc.tolist()
        needed = {n for n in lora_names if n}
        slot_of = {name: self._slot_for(name, needed) for name in needed}
        token_slots: list[int] = []
        for i, name in enumerate(lora_names):
            token_slots += [slot_of[name] if name is not None else -1] * (starts[i + 1] - starts[i])
        self.step.set_tokens(token_slots)

    @contextmanager
    def logit_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """Within: ``lm_head`` gets the hidden states of these token rows (then: no adapter on it)."""
        self.step.select_logit_rows(rows.tolist())
        try:
            yield
        finally:
            self.step.logits_plan = None

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self.slots:
            held = self.slots.index(name)
            self.slot_use.move_to_end(held)
            return held
        free = next((s for s in self.slot_use if self.slots[s] is None), None)
        if free is None:
            free = next((s for s in self.slot_use if self.slots[s] not in needed), None)
            if free is None:
                raise RuntimeError(f"more adapters in one step than the {len(self.slots)} LoRA slots")
            self.evictions += 1
        slot = free
        adapter = self._adapter(name)
        for path, layer in self.layers.items():
            layer.set_slot(slot, adapter.layers.get(path))
        self.slots[slot] = name
        self.step.scale[slot] = adapter.scaling
        self.slot_use.move_to_end(slot)
        self.loads += 1
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        if name in self.retiring:
            return self.retiring[name]
        if name in self.cpu:
            self.cpu.move_to_end(name)
            return self.cpu[name]
        adapter = self._read(name, self.paths[name])
        self._cache(adapter)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """An adapter read from its folder (checked against the whole model), cut to this rank's part."""
        adapter = LoRAAdapter.load(name, path, self.shapes, self.max_rank, self.targets.target_index())
        return self.cut(adapter) if self.cut is not None else adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.name] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None)
        self.slots[slot] = None
        self.step.scale[slot] = 0.0
