"""LoRAManager: known adapters, a CPU cache of loaded ones (LRU) and the device slots a step's adapters use."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import torch
from torch import nn

from services.engine.worker.lora.lora_layer import DENSE_MAX_TOKENS, LoRALinear, LoRAStep
from services.engine.worker.lora.peft_adapter import LoRAAdapter
from services.engine.worker.model_config import ModelConfig

log = logging.getLogger(__name__)
_FUSED_SHARDS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


class LoRAManager:
    """Adapters by name: registered (path), cached on CPU (``max_cpu_loras``, LRU), in ``max_loras`` slots.

    The scheduler never runs more distinct adapters in a step than there are slots, so ``prepare`` can
    always find one: a slot whose adapter this step does not use is evicted (least recently used first).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
    ) -> None:
        self.step = LoRAStep()
        self.max_rank, self.max_cpu_loras = max_rank, max(max_cpu_loras, max_loras)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.shard_rows = {
            "self_attn.qkv_proj": [q, kv, kv],
            "self_attn.o_proj": [cfg.hidden_size],
            "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
            "mlp.down_proj": [cfg.hidden_size],
        }
        self.layers: dict[str, LoRALinear] = {}
        decoder_layers: nn.ModuleList = getattr(model, "layers")  # noqa: B009 - the decoder models have it
        for i, layer in enumerate(decoder_layers):
            for path, shards in _FUSED_SHARDS.items():
                parent_name, leaf = path.split(".")
                parent = getattr(layer, parent_name)
                wrapped = LoRALinear(getattr(parent, leaf), max_loras, shards * max_rank, dtype, self.step)
                setattr(parent, leaf, wrapped)
                self.layers[f"layers.{i}.{path}"] = wrapped
        self.paths: dict[str, str] = {}
        self.retiring: dict[str, LoRAAdapter] = {}  # unloaded, kept while requests still run under them
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self.slot_scaling = [0.0] * max_loras  # the scaling of the adapter in each slot
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
        adapter = LoRAAdapter.load(name, path, self.shard_rows, self.max_rank)
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

    def prepare(self, lora_names: list[str | None], starts: list[int]) -> None:
        """Slots for this step's adapters, and the token runs per slot (``starts``: query_start_loc)."""
        needed = {n for n in lora_names if n}
        slot_of = {name: self._slot_for(name, needed) for name in needed}
        runs: dict[int, list[tuple[int, int]]] = {}
        for i, name in enumerate(lora_names):
            if name is not None:
                runs.setdefault(slot_of[name], []).append((starts[i], starts[i + 1]))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in runs.items():
            if all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1)):
                groups.append((slot, slice(spans[0][0], spans[-1][1])))
            else:
                groups.append((slot, torch.cat([torch.arange(a, b) for a, b in spans])))
        tokens = starts[-1] if starts else 0
        if len(groups) < 3 or tokens > DENSE_MAX_TOKENS:
            self.step.set(groups, None, None)
            return
        token_slot = torch.full((tokens,), -1, dtype=torch.long)
        token_scale = torch.zeros(tokens)
        for slot, spans in runs.items():
            for a, b in spans:
                token_slot[a:b], token_scale[a:b] = slot, self.slot_scaling[slot]
        self.step.set(groups, token_slot, token_scale)

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
            layer.set_slot(slot, adapter.layers.get(path), adapter.scaling)
        self.slots[slot], self.slot_scaling[slot] = name, adapter.scaling
        self.slot_use.move_to_end(slot)
        self.loads += 1
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        if name in self.retiring:
            return self.retiring[name]
        if name in self.cpu:
            self.cpu.move_to_end(name)
            return self.cpu[name]
        adapter = LoRAAdapter.load(name, self.paths[name], self.shard_rows, self.max_rank)
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.name] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None, 0.0)
        self.slots[slot] = None
