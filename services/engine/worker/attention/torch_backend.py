"""TorchBackend: the engine's compute ops in plain PyTorch (CPU path, and the numerical reference).

Paged attention works on the whole block-major cache [num_blocks, layers, 2, block_size, Hkv, D]: a
layer's K (or V) part of one block is one contiguous row of ``block_size*Hkv*D`` values, so writes are
one ``index_copy_`` and reads gather whole block rows with ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.worker.attention.metadata import AttentionMetadata, build_metadata
from services.engine.worker.grouped_moe import grouped_moe
from services.engine.worker.rope import apply_rotary, rope_rows


@dataclass
class PrefillSeq:
    """One multi-token query run inside the flattened batch."""

    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64
    mask: torch.Tensor  # [q_len, seq_len] bool, True = attend


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The generic metadata plus this backend's per-step plan (built once, used by every layer)."""

    decode_token_idx: torch.Tensor  # [Bd] token rows of single-token queries
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64
    decode_bias: torch.Tensor  # [Bd, 1, 1, max_blocks*block_size]: 0 attend, -inf padding
    prefills: list[PrefillSeq]


def _torch_plan(meta: AttentionMetadata) -> TorchAttentionMetadata:
    """Decode rows batched under one additive mask; each multi-token query with its causal mask."""
    q_lens, seq_lens, table, bs = (
        meta.q_lens_host,
        meta.seq_lens_host,
        meta.block_tables_host,
        meta.block_size,
    )
    device = meta.slot_mapping.device
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    lens = torch.tensor(seq_lens, dtype=torch.int64)[decode_rows]
    pad = torch.arange(table.shape[1] * bs)[None, :] >= lens[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :]
    prefills = []
    for i, n in enumerate(q_lens):
        if n > 1:
            L = seq_lens[i]
            mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
            block_ids = table[i, : -(-L // bs)].long().to(device)
            prefills.append(PrefillSeq(starts[i], starts[i + 1], L, block_ids, mask.to(device)))
    return TorchAttentionMetadata(
        **{f: getattr(meta, f) for f in AttentionMetadata.__dataclass_fields__},
        decode_token_idx=torch.tensor([starts[i] for i in decode_rows], dtype=torch.int64, device=device),
        decode_block_tables=table[decode_rows].long().to(device),
        decode_bias=bias.to(device),
        prefills=prefills,
    )


class TorchBackend:
    """RMSNorm (HF semantics), rotary, SiLU-and-mul and paged attention in torch."""

    name = "torch"
    description = "paged attention and ops in plain PyTorch"

    @staticmethod
    def build_metadata(
        q_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slots: list[int],
        block_size: int,
        device: torch.device,
    ) -> TorchAttentionMetadata:
        """The step's metadata with this backend's plan (see ``_torch_plan``)."""
        return _torch_plan(build_metadata(q_lens, seq_lens, block_tables, slots, block_size, device))

    def __init__(self) -> None:
        # Gather buffers reused across layers and steps: fresh multi-MB tensors per layer cost page faults.
        self._scratch: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, slot: str) -> torch.Tensor:
        """rows[index] into a reused buffer (valid until the next gather into the same slot)."""
        n = index.numel()
        key = (slot, rows.shape[1], rows.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[key] = torch.empty(
                (max(n, 64), rows.shape[1]), dtype=rows.dtype, device=rows.device
            )
        out = buf[:n]
        torch.index_select(rows, 0, index, out=out)
        return out

    @staticmethod
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): normalize in fp32, cast back, then scale (HF Llama)."""
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), x

    @staticmethod
    def rope_inputs(
        positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_rows(positions, cos_sin_cache)

    @staticmethod
    def rotary(
        q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return grouped_moe(x, w13, w2, topk_weights, topk_ids, self.silu_and_mul)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D] of this step. Returns [T,Hq,D]."""
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchBackend.attention needs the metadata its own build_metadata made")
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
            o = F.scaled_dot_product_attention(
                qd,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=meta.decode_bias,
                scale=scale,
                enable_gqa=True,
            )
            out.index_copy_(0, meta.decode_token_idx, o[:, :, 0, :])
        for seq in meta.prefills:
            base = (seq.block_ids * n_layers + layer) * 2
            keys = self._gather(block_rows, base, "k").view(-1, hkv, d)[: seq.seq_len]
            values = self._gather(block_rows, base + 1, "v").view(-1, hkv, d)[: seq.seq_len]
            qs = q[seq.token_start : seq.token_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=seq.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[seq.token_start : seq.token_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _write(
        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> None:
        n_blocks, n_layers, _, bs, hkv, d = kv_cache.shape
        token_rows = kv_cache.view(-1, hkv * d)
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        rows = ((blocks * n_layers + layer) * 2) * bs + offsets
        token_rows.index_copy_(0, rows, k.reshape(-1, hkv * d))
        token_rows.index_copy_(0, rows + bs, v.reshape(-1, hkv * d))
