"""LoRAAdapter: a PEFT adapter folder read into per-layer (A, B) pairs that match the engine's fused layers."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

Targets = dict[str, tuple[str, int]]  # PEFT target name -> (our module path, part index in it)
_LAYER_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])\.weight$")
_TOP_KEY = re.compile(
    r"(?:.*\.)?(lm_head)\.lora_([AB])\.weight$|(?:.*\.)?(embed_tokens)\.lora_embedding_([AB])$"
)
_BASE_COPY = re.compile(
    r"(?:.*\.)?(lm_head|embed_tokens)\.base_layer\.weight$"
)  # PEFT's save_embedding_layers


@dataclass(frozen=True)
class LoRALayerWeights:
    """One module's adapter: y += (x @ a.T) @ b * scaling per shard. a [shards * r, K]: shard j's A in rows
    j*r..; b [r, N]: shard j's B^T in its output columns (an embedding's a is lora_embedding_A [r, vocab])."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's name, rank, scaling and its modules keyed by our paths (``layers.3.self_attn.qkv_proj``,
    ``lm_head``, ``embed_tokens``)."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: dict[str, LoRALayerWeights]

    @classmethod
    def load(
        cls,
        name: str,
        path: str | Path,
        shapes: dict[str, tuple[list[int], int]],
        max_rank: int,
        targets: Targets,
    ) -> LoRAAdapter:
        """Read ``path`` (adapter_config.json + adapter_model.safetensors); ``shapes`` gives each module's
        shard output sizes and input size, e.g. ``{"self_attn.qkv_proj": ([q, k, v], hidden), ...}``;
        ``targets`` the model's LoRA targets (LoRATargets.target_index)."""
        folder = Path(path)
        cfg = _read_config(folder, targets)
        rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", cfg.get("r", 0)))
        if rank < 1 or rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: r={rank} is outside 1..max_lora_rank={max_rank}")
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        layers = {}
        for (prefix, module), shards in _group(_read_pairs(folder, name, shapes, targets)).items():
            sizes, fan_in = shapes[module]
            a = torch.zeros(len(sizes) * rank, fan_in)
            b = torch.zeros(rank, sum(sizes))
            for index, (lora_a, lora_b) in shards.items():
                if lora_a.shape != (rank, fan_in) or lora_b.shape != (sizes[index], rank):
                    raise ValueError(
                        f"LoRA adapter {name!r}: {prefix}{module} shard {index} has shapes "
                        f"A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}; expected A {(rank, fan_in)}, "
                        f"B {(sizes[index], rank)}"
                    )
                start = sum(sizes[:index])
                a[index * rank : (index + 1) * rank] = lora_a.float()
                b[:, start : start + sizes[index]] = lora_b.float().t()
            layers[prefix + module] = LoRALayerWeights(a, b)
        if not layers:
            raise ValueError(f"LoRA adapter {name!r}: no lora_A / lora_B weights for the supported modules")
        return cls(name, str(folder), rank, scaling, layers)


def _read_config(folder: Path, targets: Targets) -> dict:
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
        ("trainable_token_indices", not cfg.get("trainable_token_indices")),
        ("rank_pattern", not cfg.get("rank_pattern")),
        ("alpha_pattern", not cfg.get("alpha_pattern")),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
    ):
        if not ok:
            raise ValueError(f"LoRA adapter: {field}={cfg.get(field)!r} is not supported")
    wanted = cfg.get("target_modules") or []
    names = [wanted] if isinstance(wanted, str) else list(wanted)
    bad = sorted(t for t in names if t.rsplit(".", 1)[-1] not in targets)
    if bad:
        raise ValueError(
            f"LoRA adapter: target_modules {bad} are not supported (supported: {sorted(targets)})"
        )
    return cfg


def _read_pairs(
    folder: Path, name: str, shapes: dict[str, tuple[list[int], int]], targets: Targets
) -> dict[tuple[str, str, int], dict[str, torch.Tensor]]:
    """(module prefix, our module, shard) -> {"A": ..., "B": ...} from the safetensors file."""
    from safetensors.torch import load_file

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors")
    pairs: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights)).items():
        if (copy := _BASE_COPY.match(key)) is not None:  # the base weights PEFT saves beside the LoRA
            module = copy.group(1)
            vocab, hidden = shapes["lm_head"][0][0], shapes["embed_tokens"][0][0]
            if tuple(tensor.shape) != (vocab, hidden):
                raise ValueError(
                    f"LoRA adapter {name!r}: {key} has shape {tuple(tensor.shape)}, not the base model's "
                    f"{(vocab, hidden)}; an extended or resized vocabulary is not supported"
                )
            continue
        if (m := _LAYER_KEY.match(key)) is not None and m.group(2) in targets:
            prefix, target, which = f"layers.{m.group(1)}.", m.group(2), m.group(3)
        elif (m := _TOP_KEY.match(key)) is not None:
            prefix, target, which = "", m.group(1) or m.group(3), m.group(2) or m.group(4)
        else:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a supported LoRA weight")
        module, index = targets[target]
        pairs.setdefault((prefix, module, index), {})[which] = tensor
    return pairs


def _group(
    pairs: dict[tuple[str, str, int], dict[str, torch.Tensor]],
) -> dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    grouped: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (prefix, module, index), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter: {prefix}{module} has lora_{''.join(ab)} without its pair")
        grouped.setdefault((prefix, module), {})[index] = (ab["A"], ab["B"])
    return grouped
