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
    first_pos: int  # position of the first key gathered (block-aligned)
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64, from the block holding first_pos
    mask: torch.Tensor  # [q_len, seq_len - first_pos] bool, True = attend


@dataclass
class WindowPlan:
    """What the layers of one attention span (0 = the whole context, else a sliding window) gather."""

    decode_block_tables: torch.Tensor  # [Bd, cols] int64: each decode row's blocks from its window on
    decode_bias: torch.Tensor  # [Bd, 1, 1, cols*block_size]: 0 attend, -inf outside the row's span
    prefills: list[PrefillSeq]


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The generic metadata plus this backend's per-step plans (built once, used by every layer)."""

    decode_token_idx: torch.Tensor  # [Bd] token rows of single-token queries
    plans: dict[int, WindowPlan]  # by window (0 = full attention), built on first use

    def plan(self, window: int) -> WindowPlan:
        if window not in self.plans:
            self.plans[window] = _window_plan(self, window)
        return self.plans[window]


def _torch_plan(meta: AttentionMetadata) -> TorchAttentionMetadata:
    """Decode rows batched under one additive mask; each multi-token query with its own mask."""
    starts = [0]
    for n in meta.q_lens_host:
        starts.append(starts[-1] + n)
    decode_rows = [starts[i] for i, n in enumerate(meta.q_lens_host) if n == 1]
    return TorchAttentionMetadata(
        **{f: getattr(meta, f) for f in AttentionMetadata.__dataclass_fields__},
        decode_token_idx=torch.tensor(decode_rows, dtype=torch.int64, device=meta.slot_mapping.device),
        plans={},
    )


def _window_plan(meta: AttentionMetadata, window: int) -> WindowPlan:
    """Per decode row its blocks from the first one its span touches; per prefill its keys and mask."""
    q_lens, seq_lens, table, bs = (
        meta.q_lens_host,
        meta.seq_lens_host,
        meta.block_tables_host,
        meta.block_size,
    )
    device = meta.slot_mapping.device
    rows = [i for i, n in enumerate(q_lens) if n == 1]
    lens = torch.tensor(seq_lens, dtype=torch.int64)[rows]
    lo = (lens - window).clamp_(min=0) if window > 0 else torch.zeros_like(lens)
    first_block = lo // bs
    cols = int((-(-lens // bs) - first_block).max()) if rows else 1
    col = first_block[:, None] + torch.arange(cols)[None, :]
    ids = table[rows].long().gather(1, col.clamp(max=table.shape[1] - 1)) if rows else table[:0].long()
    pos = (col * bs)[:, :, None] + torch.arange(bs)[None, None, :]
    outside = ((pos < lo[:, None, None]) | (pos >= lens[:, None, None])).flatten(1)
    bias = torch.zeros(outside.shape).masked_fill_(outside, float("-inf"))[:, None, None, :]
    prefills, start = [], 0
    for i, n in enumerate(q_lens):
        if n > 1:
            L = seq_lens[i]
            q_pos = torch.arange(L - n, L)[:, None]
            first = max(0, L - n - window + 1) // bs * bs if window > 0 else 0
            k_pos = torch.arange(first, L)[None, :]
            mask = k_pos <= q_pos
            if window > 0:
                mask &= k_pos > q_pos - window
            block_ids = table[i, first // bs : -(-L // bs)].long().to(device)
            prefills.append(PrefillSeq(start, start + n, first, L, block_ids, mask.to(device)))
        start += n
    return WindowPlan(ids.to(device), bias.to(device), prefills)


def _with_sinks(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: K = V = 0 (score 0, nothing added to the output) with the head's
    sink as its additive bias, so each head's softmax runs over [scores, sink] and the sink's share of the
    probability mass is dropped. keys / values [..., L, Hkv, D]; bias [..., 1 | Hq, Q, L] (0 / -inf)."""
    extra = keys.new_zeros((*keys.shape[:-3], 1, *keys.shape[-2:]))
    hq = sinks.shape[0]
    bias = bias.expand(*bias.shape[:-3], hq, *bias.shape[-2:])
    column = sinks.to(bias.dtype)[:, None, None].expand(*bias.shape[:-1], 1)
    return (
        torch.cat((keys, extra), dim=-3),
        torch.cat((values, extra), dim=-3),
        torch.cat((bias, column), dim=-1),
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
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return grouped_moe(x, w13, w2, topk_weights, topk_ids, self.silu_and_mul, w13_scale, w2_scale)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D] of this step (window > 0: each query sees its last ``window``
        positions; sinks [Hq]: attention-sink logits, see ``_with_sinks``). Returns [T,Hq,D]."""
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchBackend.attention needs the metadata its own build_metadata made")
        n_blocks, n_layers, _, bs, hkv, d = kv_cache.shape
        self._write(k, v, kv_cache, layer, meta)
        block_rows = kv_cache.view(n_blocks * n_layers * 2, bs * hkv * d)
        out = torch.empty_like(q)
        plan = meta.plan(window)
        if meta.decode_token_idx.numel():
            base = (plan.decode_block_tables.flatten() * n_layers + layer) * 2
            bd, nb = plan.decode_block_tables.shape
            keys = self._gather(block_rows, base, "k").view(bd, nb * bs, hkv, d)
            values = self._gather(block_rows, base + 1, "v").view(bd, nb * bs, hkv, d)
            qd = q.index_select(0, meta.decode_token_idx)[:, :, None, :]  # [Bd, Hq, 1, D]
            bias: torch.Tensor = plan.decode_bias
            if sinks is not None:
                keys, values, bias = _with_sinks(keys, values, bias, sinks)
            o = F.scaled_dot_product_attention(
                qd,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=bias,
                scale=scale,
                enable_gqa=True,
            )
            out.index_copy_(0, meta.decode_token_idx, o[:, :, 0, :])
        for seq in plan.prefills:
            base = (seq.block_ids * n_layers + layer) * 2
            span = seq.seq_len - seq.first_pos
            keys = self._gather(block_rows, base, "k").view(-1, hkv, d)[:span]
            values = self._gather(block_rows, base + 1, "v").view(-1, hkv, d)[:span]
            qs = q[seq.token_start : seq.token_end].transpose(0, 1)
            mask = seq.mask
            if sinks is not None:
                bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~mask, float("-inf")
                )
                keys, values, mask = _with_sinks(keys, values, bias, sinks)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
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
