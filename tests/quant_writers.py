"""Write tiny GPTQ / AWQ checkpoints in those tools' exact on-disk layout, and their dequantized twins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column AWQ_PACK_ORDER[i]


def _asym(
    w: np.ndarray, bits: int, group: int, g_idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer codes q [K, N], zeros z [G, N] and scales s [G, N] with w[n, k] ~ s[g, n] * (q[k, n] - z[g, n])."""
    n, k = w.shape
    groups = k // group
    maxq = 2**bits - 1
    scales = np.zeros((groups, n), np.float32)
    zeros = np.zeros((groups, n), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        s = np.maximum((hi - lo) / maxq, 1e-8).astype(np.float16).astype(np.float32)
        scales[g], zeros[g] = s, np.clip(np.round(-lo / s), 0, maxq)
    q = np.clip(np.round(w.T / scales[g_idx] + zeros[g_idx]), 0, maxq).astype(np.int64)
    return q, zeros, scales


def _pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: 32 // bits consecutive rows (input features) per int32, lowest bits first."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), np.uint32)
    for j in range(per):
        out |= (q[j::per].astype(np.uint32) & (2**bits - 1)) << np.uint32(bits * j)
    return out.view(np.int32)


def _pack_cols(q: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    per = 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((q.shape[0], q.shape[1] // per), np.uint32)
    for i, col in enumerate(order):
        out |= (q[:, col::per].astype(np.uint32) & (2**bits - 1)) << np.uint32(bits * i)
    return out.view(np.int32)


def write_quantized(
    src: Path, out: Path, method: str, bits: int = 4, group: int = 32, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """Quantize ``src``'s decoder linears into ``out`` (gptq or awq); returns the dequantized twin tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    saved, twin = {}, {}
    shared_input = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
    for name, t in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
            saved[name] = t
            continue
        w = t.float().numpy()
        k = w.shape[1]
        g_idx = np.arange(k) // group
        if act_order:  # GPTQ's order follows the input's Hessian: layers reading one input share it
            layer, leaf = prefix.rsplit(".", 1)
            key = f"{layer.rsplit('.', 1)[0]}.{shared_input.get(leaf, leaf)}"
            g_idx = g_idx[np.random.default_rng(abs(hash(key)) % 2**32).permutation(k)]
        q, z, s = _asym(w, bits, group, g_idx)
        twin[name] = torch.from_numpy((s[g_idx] * (q - z[g_idx])).T.astype(np.float32).copy())
        if method == "gptq":
            saved[f"{prefix}.qweight"] = torch.from_numpy(_pack_rows(q, bits))
            saved[f"{prefix}.qzeros"] = torch.from_numpy(_pack_cols(z - 1, bits))  # v1 stores zero - 1
            saved[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            saved[f"{prefix}.qweight"] = torch.from_numpy(_pack_cols(q, bits, AWQ_PACK_ORDER))
            saved[f"{prefix}.qzeros"] = torch.from_numpy(_pack_cols(z, bits, AWQ_PACK_ORDER))
        saved[f"{prefix}.scales"] = torch.from_numpy(s.astype(np.float16))
    (out / "model.safetensors").unlink()
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm", "zero_point": True}
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return twin


def hf_twin(src: Path, replace: dict[str, torch.Tensor]):
    """The HF model of ``src`` with some weights replaced (the dequantized twin of a quantized engine)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, w in replace.items():
            params[name].copy_(w)
    return hf


def write_fp8(src: Path, out: Path, scheme: str, block: int = 32) -> dict[str, torch.Tensor]:
    """``src``'s decoder linears as FP8 E4M3 (vLLM's ``fp8`` layout) with per-tensor, per-channel or
    block scales (``weight_scale`` / block ``weight_scale_inv``) and static ``input_scale``s;
    returns the dequantized twin tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    saved, twin = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
            saved[name] = t
            continue
        w = t.float()
        n, k = w.shape
        if scheme == "tensor":
            scale = w.abs().max() / 448
            expanded = scale.expand(n, k)
        elif scheme == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            expanded = scale.expand(n, k)
        else:
            tiles = w.reshape(n // block, block, k // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / 448  # [N / b, K / b]
            expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        codes = (w / expanded).to(torch.float8_e4m3fn)
        twin[name] = codes.float() * expanded
        saved[name] = codes
        saved[f"{prefix}.{'weight_scale_inv' if scheme == 'block' else 'weight_scale'}"] = (
            scale.float().contiguous()
        )
        saved[f"{prefix}.input_scale"] = torch.tensor(0.01)
    (out / "model.safetensors").unlink()
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    qc: dict = {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"}
    if scheme == "block":
        qc["weight_block_size"] = [block, block]
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return twin


def write_mxfp4_experts(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """``src`` (a float gpt-oss checkpoint) with its experts stored as real gpt-oss checkpoints store them:
    MXFP4 ``*_blocks`` / ``*_scales`` [E, out, in / 32, ...]; returns the dequantized twin tensors (HF names
    and layouts)."""
    from safetensors.torch import load_file, save_file

    from services.engine.worker.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    shutil.copytree(src, out)
    saved, twin = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            saved[name] = t
            continue
        blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # HF's float experts are [E, in, out]
        saved[f"{name}_blocks"], saved[f"{name}_scales"] = blocks, scales
        twin[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    (out / "model.safetensors").unlink()
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return twin
