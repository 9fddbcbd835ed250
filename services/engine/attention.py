"""Paged attention: per-step metadata, the plain-torch backend (CPU and test reference), backend choice."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillSeq:
    """One multi-token query run inside the flattened batch."""

    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64
    mask: torch.Tensor  # [q_len, seq_len] bool, True = attend


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    # torch backend helpers
    decode_token_idx: torch.Tensor  # [Bd] token rows of single-token queries
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64
    decode_bias: torch.Tensor  # [Bd, 1, 1, max_blocks*block_size] float: 0 = attend, -inf = padding
    prefills: list[PrefillSeq]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(
    q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], slots: list[int], block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build metadata from per-sequence query lengths, total lengths, block ids and token slots."""
    max_blocks = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros((len(block_tables), max_blocks), dtype=torch.int32)
    for i, ids in enumerate(block_tables):
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    positions = torch.arange(max_blocks * block_size)
    pad = positions[None, :] >= lens_t[decode_rows][:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :]
    prefills = []
    for i, n in enumerate(q_lens):
        if n == 1:
            continue
        L = seq_lens[i]
        q_pos = torch.arange(L - n, L)[:, None]
        mask = torch.arange(L)[None, :] <= q_pos
        nb = -(-L // block_size)
        prefills.append(PrefillSeq(starts[i], starts[i + 1], L, table[i, :nb].long().to(device), mask.to(device)))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        block_size=block_size,
        decode_token_idx=torch.tensor([starts[i] for i in decode_rows], dtype=torch.int64, device=device),
        decode_block_tables=table[decode_rows].long().to(device),
        decode_bias=bias.to(device),
        prefills=prefills,
    )


class TorchPagedAttention:
    """Paged attention in plain torch: same math as the Triton kernels, and their reference.

    It works on the whole block-major cache [num_blocks, layers, 2, block_size, Hkv, D]: a layer's
    K (or V) part of one block is one contiguous row of ``block_size*Hkv*D`` values, so writes are
    one ``index_copy_`` and reads gather whole block rows with ``index_select``.
    """

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D] of this step. Returns [T,Hq,D]."""
        n_blocks, n_layers, _, bs, hkv, d = kv_cache.shape
        self._write(k, v, kv_cache, layer, meta)
        block_rows = kv_cache.view(n_blocks * n_layers * 2, bs * hkv * d)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            base = (meta.decode_block_tables.flatten() * n_layers + layer) * 2
            bd, nb = meta.decode_block_tables.shape
            keys = block_rows.index_select(0, base).view(bd, nb * bs, hkv, d)
            values = block_rows.index_select(0, base + 1).view(bd, nb * bs, hkv, d)
            qd = q.index_select(0, meta.decode_token_idx)[:, :, None, :]  # [Bd, Hq, 1, D]
            o = F.scaled_dot_product_attention(qd, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=meta.decode_bias, scale=scale, enable_gqa=True)
            out.index_copy_(0, meta.decode_token_idx, o[:, :, 0, :])
        for seq in meta.prefills:
            base = (seq.block_ids * n_layers + layer) * 2
            keys = block_rows.index_select(0, base).view(-1, hkv, d)[: seq.seq_len]
            values = block_rows.index_select(0, base + 1).view(-1, hkv, d)[: seq.seq_len]
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


def select_backend(device: torch.device, override: str | None = None) -> TorchPagedAttention:
    """Triton kernels on CUDA, plain torch elsewhere; ``override`` forces one ('torch' | 'triton')."""
    choice = override or ("triton" if device.type == "cuda" else "torch")
    if choice == "triton":
        raise ValueError("attention backend 'triton' is not available in this build yet (use 'torch')")
    if choice != "torch":
        raise ValueError(f"attention_backend={choice!r} is unknown (choose 'torch' or 'triton')")
    log.info("attention backend: torch (paged, plain PyTorch) on %s", device)
    return TorchPagedAttention()
