"""QuantConfig: the weight-only quantization a model runs with, from --quantization and the checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Method = Literal["none", "int8", "int4", "gguf", "gptq", "awq", "fp8"]
FLAG_CHOICES = ("auto", "none", "int8", "int4", "gguf", "gptq", "awq", "fp8")
SUPPORTED = (
    "GGUF Q4_0/Q4_1/Q4_K (int4 codes kept), Q8_0/Q6_K/Q5_0/Q5_1/Q5_K (run as int8), F32/F16/BF16; "
    "GPTQ 4/8-bit (any group size, act-order); AWQ 4-bit GEMM; FP8 E4M3 (per-tensor, per-channel or "
    "block scales; run as int8 on CPU); int8 and int4 at load of a float checkpoint, fp8 at load on GPUs"
)


class QuantConfig(BaseModel):
    """How a model's linear layers hold their weights."""

    model_config = ConfigDict(frozen=True)

    method: Method = "none"
    bits: int = 16
    group_size: int = -1  # -1: one scale per output channel
    desc_act: bool = False
    lm_head: bool = True  # quantize the output projection (and a tied embedding) too
    gguf_types: dict[str, int] = {}  # tensor type -> count, for GGUF checkpoints
    at_load: bool = False  # quantized from a float checkpoint while loading (not read from it)

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    def describe(self) -> str:
        """One line for logs, /v1/models and kvferry_cache_config_info."""
        if self.method == "gguf":
            return "gguf(" + ",".join(f"{t}x{n}" for t, n in sorted(self.gguf_types.items())) + ")"
        if self.method in ("gptq", "awq"):
            return f"{self.method}({self.bits}-bit, group {self.group_size}{', act-order' if self.desc_act else ''})"
        if self.method == "fp8" and not self.at_load:
            return f"fp8({'block ' + str(self.group_size) if self.group_size > 0 else 'per-row'} scales)"
        return self.method


def resolve_quant_config(flag: str, model: str | Path) -> QuantConfig:
    """``flag`` (``auto`` = whatever the checkpoint is) checked against the checkpoint and the device."""
    if flag not in FLAG_CHOICES:
        raise ValueError(f"quantization {flag!r} is not one of {', '.join(FLAG_CHOICES)}")
    found = detect(Path(model))
    if flag == "auto":
        return found
    if flag == "none":
        return QuantConfig()  # a quantized checkpoint is dequantized to --dtype on load
    if flag in ("int8", "int4") or (flag == "fp8" and found.method == "none"):
        if found.method in ("gptq", "awq", "fp8"):
            raise ValueError(
                f"quantization {flag}: the checkpoint is already {found.describe()}; use --quantization auto"
            )
        bits = 4 if flag == "int4" else 8
        return QuantConfig(method=flag, bits=bits, group_size=32 if bits == 4 else -1, at_load=True)
    if found.method != flag:
        raise ValueError(f"quantization {flag}: the checkpoint {model} is {found.describe()}, not {flag}")
    return found


def detect(path: Path) -> QuantConfig:
    """What the checkpoint holds: GGUF tensor types, or config.json's ``quantization_config``."""
    if path.suffix == ".gguf":
        return _detect_gguf(path)
    cfg_file = path / "config.json"
    qc: dict[str, Any] = (
        json.loads(cfg_file.read_text()).get("quantization_config") or {} if cfg_file.is_file() else {}
    )
    if not qc:
        return QuantConfig()
    method = str(qc.get("quant_method", "")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 0)) or 0)
    group = int(qc.get("group_size", qc.get("q_group_size", -1)) or -1)
    if method == "mxfp4":  # gpt-oss: its model class keeps the MXFP4 experts packed; every linear is float
        return QuantConfig()
    if method == "gptq" and bits in (4, 8):
        return QuantConfig(
            method="gptq",
            bits=bits,
            group_size=group,
            desc_act=bool(qc.get("desc_act")),
            lm_head=bool(qc.get("lm_head", False)),
        )
    if method == "awq" and bits == 4 and str(qc.get("version", "gemm")).lower() == "gemm":
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points is not supported; supported: " + SUPPORTED)
        return QuantConfig(method="awq", bits=4, group_size=group, lm_head=False)
    if method in ("fp8", "compressed-tensors") and _is_fp8(qc):
        block = qc.get("weight_block_size")
        if block and (len(block) != 2 or block[0] != block[1]):
            raise ValueError(
                f"FP8 weight_block_size {block} is not supported (square blocks only); supported: {SUPPORTED}"
            )
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')} is not supported; supported: {SUPPORTED}")
        return QuantConfig(method="fp8", bits=8, group_size=int(block[0]) if block else -1, lm_head=False)
    what = f"{method or 'unknown'} {bits}-bit" if bits else method or "unknown"
    if method == "awq":
        what += f" ({qc.get('version', 'gemm')} layout)"
    raise ValueError(f"checkpoint quantization {what} is not supported; supported: {SUPPORTED}")


def _detect_gguf(path: Path) -> QuantConfig:
    from services.engine.worker.loader.gguf import gguf_reader
    from services.engine.worker.quantization.gguf_blocks import FLOAT_TYPES, SUPPORTED_TYPES

    types = Counter(t.tensor_type.name for t in gguf_reader(path).tensors)
    bad = sorted(set(types) - SUPPORTED_TYPES)
    if bad:
        raise ValueError(
            f"GGUF tensor type(s) {', '.join(bad)} in {path.name} are not supported; supported: {SUPPORTED}"
        )
    if set(types) <= FLOAT_TYPES:
        return QuantConfig()
    return QuantConfig(method="gguf", bits=4, group_size=32, gguf_types=dict(types))


def _is_fp8(qc: dict[str, Any]) -> bool:
    """vLLM's ``fp8`` method, or compressed-tensors' float 8-bit weights (``float-quantized``)."""
    if qc.get("quant_method") == "fp8":
        return True
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    return bool(weights) and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)
