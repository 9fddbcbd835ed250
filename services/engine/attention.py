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
    decode_mask: torch.Tensor  # [Bd, max_blocks*block_size] bool
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
    decode_lens = lens_t[decode_rows]
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
        decode_mask=(positions[None, :] < decode_lens[:, None]).to(device),
        prefills=prefills,
    )


class TorchPagedAttention:
    """Paged attention in plain torch: same math as the Triton kernels, and their reference."""

    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        blocks = meta.slot_mapping // meta.block_size
        offsets = meta.slot_mapping % meta.block_size
        key_cache[blocks, offsets] = k
        value_cache[blocks, offsets] = v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D]; caches [num_blocks, block_size, Hkv, D]. Returns [T,Hq,D]."""
        self.write_kv(k, v, key_cache, value_cache, meta)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            out[meta.decode_token_idx] = self._decode(q[meta.decode_token_idx], key_cache, value_cache, meta, scale)
        for seq in meta.prefills:
            out[seq.token_start : seq.token_end] = self._prefill(
                q[seq.token_start : seq.token_end], key_cache, value_cache, seq, scale
            )
        return out

    @staticmethod
    def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        bd, hq, d = q.shape
        hkv = key_cache.shape[2]
        keys = key_cache[meta.decode_block_tables].flatten(1, 2)  # [Bd, L, Hkv, D]
        values = value_cache[meta.decode_block_tables].flatten(1, 2)
        qg = q.view(bd, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale
        scores = scores.masked_fill(~meta.decode_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhgl,blhd->bhgd", probs, values).reshape(bd, hq, d)

    @staticmethod
    def _prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq: PrefillSeq,
                 scale: float) -> torch.Tensor:
        keys = key_cache[seq.block_ids].flatten(0, 1)[: seq.seq_len]  # [L, Hkv, D]
        values = value_cache[seq.block_ids].flatten(0, 1)[: seq.seq_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=seq.mask, scale=scale, enable_gqa=True,
        )
        return out.transpose(0, 1)


def select_backend(device: torch.device, override: str | None = None) -> TorchPagedAttention:
    """Triton kernels on CUDA, plain torch elsewhere; ``override`` forces one ('torch' | 'triton')."""
    choice = override or ("triton" if device.type == "cuda" else "torch")
    if choice == "triton":
        raise ValueError("attention backend 'triton' is not available in this build yet (use 'torch')")
    if choice != "torch":
        raise ValueError(f"attention_backend={choice!r} is unknown (choose 'torch' or 'triton')")
    log.info("attention backend: torch (paged, plain PyTorch) on %s", device)
    return TorchPagedAttention()
