"""GPTQ and AWQ checkpoints: their packed qweight / qzeros / scales (/ g_idx) tensors as GroupQuantWeight."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight
from services.engine.worker.quantization.quant_config import QuantConfig

AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of 8 sits in nibble AWQ_COLUMN_NIBBLE[c]
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 into 32 // bits codes (lowest bits first) along ``dim``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.to(torch.int32).unsqueeze(-1) >> shifts
    codes = (x & (2**bits - 1)).to(torch.uint8)  # [..., per] along the last axis
    if dim == 0:  # packed rows: [R, C, per] -> [R * per, C]
        return codes.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])
    return codes.reshape(packed.shape[0], packed.shape[1] * per)


def gptq_weight(parts: dict[str, torch.Tensor], bits: int, group: int) -> GroupQuantWeight:
    """GPTQ (v1 layout): qweight [K/pack, N] packed along K, qzeros [G, N/pack] stored as zero - 1."""
    q = unpack_int32(parts["qweight"], bits, dim=0).t()  # [N, K]
    zeros = unpack_int32(parts["qzeros"], bits, dim=1).float() + 1  # [G, N]
    scales = parts["scales"].float()  # [G, N]
    n, k = q.shape
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // (group if group > 0 else k)
    g_idx = g_idx.long()
    perm = torch.sort(g_idx, stable=True).indices
    trivial = bool(torch.equal(perm, torch.arange(k)))
    sorted_g = g_idx[perm]
    counts = torch.bincount(sorted_g)
    size = int(counts[0])
    if bool((counts != size).any()) or k % size:
        raise ValueError("GPTQ g_idx does not split the input into equal groups")
    order = sorted_g[::size]  # the group of each contiguous block after sorting
    return GroupQuantWeight(
        q[:, perm].contiguous(),
        scales[order].t().contiguous(),
        (-zeros[order] * scales[order]).t().contiguous(),
        bits,
        size,
        None if trivial else perm,
    )


def awq_weight(parts: dict[str, torch.Tensor], bits: int, group: int) -> GroupQuantWeight:
    """AWQ GEMM layout: qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's nibble order."""
    order = torch.tensor(AWQ_COLUMN_NIBBLE)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        codes = unpack_int32(t, bits, dim=1).view(t.shape[0], -1, 8)
        return codes[..., order].reshape(t.shape[0], -1)

    q = unpack(parts["qweight"]).t().contiguous()  # [N, K]
    zeros = unpack(parts["qzeros"]).float()  # [G, N]
    scales = parts["scales"].float()
    return GroupQuantWeight(q, scales.t().contiguous(), (-zeros * scales).t().contiguous(), bits, group)


def iter_packed(
    tensors: Iterable[tuple[str, torch.Tensor]], qcfg: QuantConfig
) -> Iterator[tuple[str, object]]:
    """Yield float tensors as they come, then each packed layer as ``(prefix + '.weight', GroupQuantWeight)``."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS:
            packed.setdefault(prefix, {})[part] = tensor
        else:
            yield name, tensor
    build = gptq_weight if qcfg.method == "gptq" else awq_weight
    for prefix, parts in packed.items():
        missing = {"qweight", "qzeros", "scales"} - parts.keys()
        if missing:
            raise ValueError(f"{qcfg.method} checkpoint: {prefix} lacks {sorted(missing)}")
        yield f"{prefix}.weight", build(parts, qcfg.bits, qcfg.group_size)
