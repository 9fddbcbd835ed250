"""LoRAAdapter: a PEFT adapter folder read into per-layer (A, B) pairs that match the engine's fused layers."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# PEFT target name -> (our fused module, shard index, shards in that module)
_TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRALayerWeights:
    """One fused layer's adapter: y += (x @ a.T) @ b.T * scaling; a [R, K], b [N, R] (block-diagonal over shards)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's name, rank, scaling and its layers keyed by our module paths (``layers.3.self_attn.qkv_proj``)."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: dict[str, LoRALayerWeights]

    @classmethod
    def load(
        cls, name: str, path: str | Path, shard_rows: dict[str, list[int]], max_rank: int
    ) -> LoRAAdapter:
        """Read ``path`` (adapter_config.json + adapter_model.safetensors); ``shard_rows`` gives each fused
        module's shard output sizes, e.g. ``{"self_attn.qkv_proj": [q, k, v], ...}``."""
        folder = Path(path)
        cfg = _read_config(folder)
        rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", cfg.get("r", 0)))
        if rank < 1 or rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: r={rank} is outside 1..max_lora_rank={max_rank}")
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        pairs = _read_pairs(folder, name)
        layers = {}
        for (layer, fused), shards in _group(pairs).items():
            sizes = shard_rows[fused]
            a_parts, b_blocks = [], []
            for index, (a, b) in sorted(shards.items()):
                if a.shape[0] != rank or b.shape[1] != rank or b.shape[0] != sizes[index]:
                    raise ValueError(
                        f"LoRA adapter {name!r}: layer {layer} {fused} shard {index} has shapes "
                        f"A {tuple(a.shape)}, B {tuple(b.shape)}; expected rank {rank}, rows {sizes[index]}"
                    )
                a_parts.append(a.float())
                block = torch.zeros(sum(sizes), rank)
                start = sum(sizes[:index])
                block[start : start + sizes[index]] = b.float()
                b_blocks.append(block)
            layers[f"layers.{layer}.{fused}"] = LoRALayerWeights(
                torch.cat(a_parts), torch.cat(b_blocks, dim=1)
            )
        if not layers:
            raise ValueError(f"LoRA adapter {name!r}: no lora_A / lora_B weights for the supported modules")
        return cls(name, str(folder), rank, scaling, layers)


def _read_config(folder: Path) -> dict:
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter: {folder} has no adapter_config.json")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter: peft_type {cfg.get('peft_type')!r} is not LORA")
    for field, ok in (
        ("use_dora", not cfg.get("use_dora")),
        ("bias", cfg.get("bias", "none") == "none"),
        ("modules_to_save", not cfg.get("modules_to_save")),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
    ):
        if not ok:
            raise ValueError(f"LoRA adapter: {field}={cfg.get(field)!r} is not supported")
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    bad = sorted(t for t in names if t.rsplit(".", 1)[-1] not in _TARGETS)
    if bad:
        raise ValueError(
            f"LoRA adapter: target_modules {bad} are not supported (supported: {sorted(_TARGETS)})"
        )
    return cfg


def _read_pairs(folder: Path, name: str) -> dict[tuple[int, str, int], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors")
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights)).items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a supported LoRA weight")
        fused, index = _TARGETS[m.group(3)]
        pairs.setdefault((int(m.group(1)), fused, index), {})[m.group(4)] = tensor
    return pairs


def _group(
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]],
) -> dict[tuple[int, str], dict[int, tuple]]:
    grouped: dict[tuple[int, str], dict[int, tuple]] = {}
    for (layer, fused, index), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter: layer {layer} {fused} has lora_{''.join(ab)} without its pair")
        grouped.setdefault((layer, fused), {})[index] = (ab["A"], ab["B"])
    return grouped
