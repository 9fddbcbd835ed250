"""TorchBackend: the engine's compute ops in plain PyTorch (CPU path, and the numerical reference).

Paged attention works on the whole block-major cache [num_blocks, layers, 2, block_size, Hkv, D]: a
layer's K (or V) part of one block is one contiguous row of ``block_size*Hkv*D`` values, so writes are
one ``index_copy_`` and reads gather whole block rows with ``index_select``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.attention import AttentionMetadata
from services.engine.rotary import apply_rotary, rope_rows


class TorchBackend:
    """RMSNorm (HF semantics), rotary, SiLU-and-mul and paged attention in torch."""

    name = "torch"
    description = "paged attention and ops in plain PyTorch"

    def __init__(self) -> None:
        # Gather buffers reused across layers and steps: fresh multi-MB tensors per layer cost page faults.
        self._scratch: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, slot: str) -> torch.Tensor:
        """rows[index] into a reused buffer (valid until the next gather into the same slot)."""
        n = index.numel()
        key = (slot, rows.shape[1], rows.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[key] = torch.empty((max(n, 64), rows.shape[1]), dtype=rows.dtype, device=rows.device)
        out = buf[:n]
        torch.index_select(rows, 0, index, out=out)
        return out

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): normalize in fp32, cast back, then scale (HF Llama)."""
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), x

    @staticmethod
    def rope_inputs(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_rows(positions, cos_sin_cache)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D] of this step. Returns [T,Hq,D]."""
        n_blocks, n_layers, _, bs, hkv, d = kv_cache.shape
        self._write(k, v, kv_cache, layer, meta)
        block_rows = kv_cache.view(n_blocks * n_layers * 2, bs * hkv * d)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            base = (meta.decode_block_tables.flatten() * n_layers + layer) * 2
            bd, nb = meta.decode_block_tables.shape
            keys = self._gather(block_rows, base, "k").view(bd, nb * bs, hkv, d)
            values = self._gather(block_rows, base + 1, "v").view(bd, nb * bs, hkv, d)
            qd = q.index_select(0, meta.decode_token_idx)[:, :, None, :]  # [Bd, Hq, 1, D]
            o = F.scaled_dot_product_attention(qd, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=meta.decode_bias, scale=scale, enable_gqa=True)
            out.index_copy_(0, meta.decode_token_idx, o[:, :, 0, :])
        for seq in meta.prefills:
            base = (seq.block_ids * n_layers + layer) * 2
            keys = self._gather(block_rows, base, "k").view(-1, hkv, d)[: seq.seq_len]
            values = self._gather(block_rows, base + 1, "v").view(-1, hkv, d)[: seq.seq_len]
            qs = q[seq.token_start : seq.token_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, keys.transpose(0, 1), values.transpose(0, 1),
                                               attn_mask=seq.mask, scale=scale, enable_gqa=True)
            out[seq.token_start : seq.token_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata) -> None:
        n_blocks, n_layers, _, bs, hkv, d = kv_cache.shape
        token_rows = kv_cache.view(-1, hkv * d)
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        rows = ((blocks * n_layers + layer) * 2) * bs + offsets
        token_rows.index_copy_(0, rows, k.reshape(-1, hkv * d))
        token_rows.index_copy_(0, rows + bs, v.reshape(-1, hkv * d))
