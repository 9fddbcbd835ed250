"""MLAAttention: DeepSeek's multi-head latent attention over a paged cache of latents (one token's
[c_kv | k_pe] per layer, one head shared by all query heads), computed with the absorbed weights: each
query head is taken into latent space (q_nope @ W_UK), scored against the cached latents, its output is the
weighted sum of the c_kv parts, taken back out through W_UV and o_proj.

The cache keeps the engine's block-major layout [blocks, layers, 2, block_size, 1, latent / 2]: a token's
latent is split over the block's K half (its first half) and V half (its second), so paging, prefix caching
and the P/D ferry move latents exactly as they move K and V. Written in plain torch (no kernel yet)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention import ComputeBackend as Backend
from services.engine.worker.model_config import ModelConfig
from services.engine.worker.models.llama import RMSNorm
from services.engine.worker.rope import apply_rotary


@dataclass(frozen=True)
class PrefillRun:
    """One multi-token query: its token rows, the blocks holding its whole context, and its causal mask."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor  # [end - start, seq_len] bool, True = attend


@dataclass(frozen=True)
class LatentPlan:
    """What every MLA layer of one step reads: decode rows batched over padded block lists, each
    multi-token query on its own (built once per step from the engine's metadata)."""

    meta: AttentionMetadata
    decode_rows: torch.Tensor  # [Bd] token rows of single-token queries
    decode_blocks: torch.Tensor  # [Bd, cols] int64
    decode_bias: torch.Tensor  # [Bd, 1, 1, cols * block_size]: 0 attend, -inf past the row's length
    prefills: tuple[PrefillRun, ...]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> LatentPlan:
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
        rows = [i for i, n in enumerate(q_lens) if n == 1]
        lens = torch.tensor([seq_lens[i] for i in rows], dtype=torch.int64)
        cols = int(-(-lens.max() // bs)) if rows else 1
        blocks = table[rows, :cols].long() if rows else table[:0, :1].long()
        outside = torch.arange(cols * bs)[None, :] >= lens[:, None]
        bias = torch.zeros(outside.shape).masked_fill_(outside, float("-inf"))[:, None, None, :]
        prefills = []
        for i, n in enumerate(q_lens):
            if n > 1:
                length = seq_lens[i]
                mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
                ids = table[i, : -(-length // bs)].long().to(device)
                prefills.append(PrefillRun(starts[i], starts[i] + n, length, ids, mask.to(device)))
        decode_rows = torch.tensor([starts[i] for i in rows], dtype=torch.int64, device=device)
        return cls(meta, decode_rows, blocks.to(device), bias.to(device), tuple(prefills))


def write_latents(kv_cache: torch.Tensor, layer: int, latent: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's latents [T, latent] at their slots (first half in K, second half in V)."""
    half = kv_cache.shape[-1]
    blocks, offsets = meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size
    kv_cache[blocks, layer, 0, offsets, 0] = latent[:, :half].to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets, 0] = latent[:, half:].to(kv_cache.dtype)


def read_latents(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
    """The latents of ``block_ids`` [..., N] -> [..., N * block_size, latent], in position order."""
    rows = kv_cache[block_ids.reshape(-1), layer, :, :, 0]  # [n, 2, bs, half]
    rows = rows.transpose(1, 2).reshape(*block_ids.shape, -1, 2 * kv_cache.shape[-1])
    return rows.flatten(-3, -2)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3) as rotate-half halves (evens, then odds)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentProjection(nn.Module):
    """kv_b_proj's [H * (nope + v), kv_lora_rank] weight, read as the per-head W_UK and W_UV matrices (not an
    nn.Linear: no packer or quantizer rewrites it, it is never applied as a linear)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class MLAAttention(nn.Module):
    """Query through q_a_proj / q_a_layernorm / q_b_proj (or a plain ``q_plain``, HF's q_proj), the latent
    through kv_a_proj_with_mqa / kv_a_layernorm, kv_b_proj's rows as W_UK and W_UV."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, scale: float) -> None:
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError(f"{cfg.architecture}: the config declares no kv_lora_rank (not an MLA model)")
        self.cache_idx, self.mla, self.scale = layer_idx, mla, scale
        h, hidden, qk = cfg.num_attention_heads, cfg.hidden_size, mla.qk_head_dim
        self.heads = h
        if mla.q_lora_rank:
            self.q_a_proj: nn.Linear | None = nn.Linear(hidden, mla.q_lora_rank, bias=False)
            self.q_a_layernorm: RMSNorm | None = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * qk, bias=False)
        else:
            self.q_a_proj, self.q_a_layernorm = None, None
            self.q_plain = nn.Linear(hidden, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_size, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = LatentProjection(h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = nn.Linear(h * mla.v_head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        plan: LatentPlan,
        backend: Backend,
    ) -> torch.Tensor:
        mla, t, h = self.mla, x.shape[0], self.heads
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x), backend)[0])
        else:
            q = self.q_plain(x)
        q_nope, q_pe = q.view(t, h, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous(), backend)[0]
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        cos, sin = rope
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe[:, None, :], cos, sin)[:, 0]
        write_latents(kv_cache, self.cache_idx, torch.cat((c_kv, k_pe), dim=-1), plan.meta)
        w = self.kv_b_proj.weight.view(h, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe), dim=-1)  # [T, H, latent]
        out = torch.einsum("thr,hvr->thv", self._attend(query, kv_cache, plan), w_uv)
        return self.o_proj(out.reshape(t, h * mla.v_head_dim))

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: LatentPlan) -> torch.Tensor:
        """query [T, H, latent] against the cached latents -> [T, H, kv_lora_rank] (latent-space values)."""
        r = self.mla.kv_lora_rank
        out = query.new_empty((*query.shape[:2], r))
        if plan.decode_rows.numel():
            keys = read_latents(kv_cache, self.cache_idx, plan.decode_blocks).to(query.dtype)[:, None]
            qd = query.index_select(0, plan.decode_rows)[:, :, None, :]  # [Bd, H, 1, latent]
            o = _sdpa(qd, keys, plan.decode_bias.to(query.dtype), self.scale, r)
            out.index_copy_(0, plan.decode_rows, o[:, :, 0, :])
        for run in plan.prefills:
            keys = read_latents(kv_cache, self.cache_idx, run.block_ids)[: run.seq_len].to(query.dtype)
            qs = query[run.start : run.end].transpose(0, 1)  # [H, n, latent]
            out[run.start : run.end] = _sdpa(qs, keys[None], run.mask, self.scale, r).transpose(0, 1)
        return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, r: int) -> torch.Tensor:
    """Attention of q [..., H, Q, latent] over one shared head keys [..., 1, K, latent], values its first r
    columns (c_kv)."""
    k = keys.expand(*q.shape[:-2], *keys.shape[-2:])
    return F.scaled_dot_product_attention(q, k, k[..., :r], attn_mask=mask, scale=scale)
