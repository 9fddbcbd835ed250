"""Pure-torch twins of every Triton kernel: the executable spec each kernel is tested against."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V into cache slot `slot_mapping[t]` (block * block_size + offset); skip slot < 0."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` positions of one sequence as a dense [seq_len, Hkv, D] tensor."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    first_pos: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention in fp32: q [Q, Hq, D] at positions first_pos.., k/v [L, Hkv, D] -> [Q, Hq, D].

    window > 0: a query at position p sees only positions (p - window, p] (sliding-window attention).
    sinks [Hq]: gpt-oss attention sinks, the softmax of head h runs over [scores, sinks[h]] and the sink's
    column is dropped (it only adds to the denominator)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window > 0:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    sink = sinks.float().to(q.device)[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def ref_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its first seq_lens[b] cached positions (the last ``window`` of
    them when window > 0; sinks [Hq]: per-head attention-sink logits); a row with seq_len 0 is 0."""
    del num_splits  # a scheduling choice of the kernel; the math is the same
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[b], seq_len)
        v = gather_kv(value_cache, block_tables[b], seq_len)
        out[b] = _attend(query[b : b + 1], k, v, scale, seq_len - 1, window, sinks)[0].to(query.dtype)
    return out


def ref_paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's packed queries (its LAST q_len positions) over its paged K/V
    (window > 0: each query over its last ``window`` positions only; sinks [Hq]: attention sinks)."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        k = gather_kv(key_cache, block_tables[b], seq_len)
        v = gather_kv(value_cache, block_tables[b], seq_len)
        first_pos = seq_len - (q_end - q_start)
        out[q_start:q_end] = _attend(query[q_start:q_end], k, v, scale, first_pos, window, sinks).to(
            query.dtype
        )
    return out


def ref_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Llama RMSNorm (normalize in fp32, cast to x.dtype, times weight); with residual: r = x + residual."""
    if residual is not None:
        r = x + residual
        return _rms_norm(r, weight, eps), r
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a residual (see ref_rms_norm)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x [T, H, D] in fp32; the rest pass through."""
    rot_dim = 2 * cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def ref_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D]: neox = HF rotate_half halves, else GPT-J interleaved pairs."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """HF transformers' llama3 frequency adjustment (same operations in the same order)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict
) -> tuple[torch.Tensor, float]:
    """HF transformers' YaRN frequencies and attention factor (gpt-oss): extrapolated (original) frequencies
    for the fast dimensions, interpolated (divided by ``factor``) for the slow ones, a linear ramp between,
    and cos/sin scaled by 0.1 * ln(factor) + 1 unless ``attention_factor`` is given (or, DeepSeek, by
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set)."""
    for field in ("factor", "original_max_position_embeddings"):
        if scaling.get(field) is None:
            raise ValueError(f"rope_parameters.{field} is required for rope_type 'yarn'")
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:  # DeepSeek: the ratio of two mscales
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    elif attention_factor is None:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[max_pos, head_dim] cache (cos half, then sin half) equal to HF LlamaRotaryEmbedding's cos/sin (YaRN:
    both times its attention factor, as HF's rotary embedding multiplies them)."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(inv_freq, head_dim, base, scaling)
    elif rope_type != "default":
        raise ValueError(
            f"rope_scaling / rope_parameters.rope_type={rope_type!r} is not supported "
            "(have: default, linear, llama3, yarn)"
        )
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if rope_type == "yarn":
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(dtype)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] computed in fp32, cast back to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def ref_dequant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """Twin of kvkernels.dequant_matmul: unpack the codes, w = code * scale + offset per group, fp32 matmul."""
    if bits == 4:
        codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1).float()
    elif fp8:
        codes = qweight.view(torch.float8_e4m3fn).float()
    else:
        codes = qweight.float()
    w = codes * scales.float().repeat_interleave(group, 1) + offsets.float().repeat_interleave(group, 1)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ref_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of kvkernels.fused_moe, one expert at a time: gather its (token, slot) rows, fp32 math.
    With scales, w13 / w2 are int8 codes: weight = code * scale of its (expert, output row).

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])) with
    e = topk_ids[t, k]; the silu * up activation is rounded to x.dtype like the kernel's, the sum over
    k stays in fp32 and the result is rounded to x.dtype once.
    """
    if w13_scale is not None and w2_scale is not None:
        w13 = w13.float() * w13_scale.float()[:, :, None]
        w2 = w2.float() * w2_scale.float()[:, :, None]
    num_tokens, topk = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(topk)
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in flat_ids.unique().tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        rows_tokens = tokens.index_select(0, rows)
        gate_up = x.index_select(0, rows_tokens).float() @ w13[expert].float().t()
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        down = act @ w2[expert].float().t()
        out.index_add_(0, rows_tokens, down * weights.index_select(0, rows)[:, None])
    return out.to(x.dtype)


def _host(values: torch.Tensor | Sequence[int]) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def ref_lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    seg_start: torch.Tensor | Sequence[int],
    seg_slot: torch.Tensor | Sequence[int],
    scale: torch.Tensor,
) -> torch.Tensor:
    """Twin of kvkernels.lora.lora_shrink (punica's shrink), one segment at a time in fp32.

    s [P, R] fp32: s[p] = (x[rows[p]] @ a[slot]^T) * scale[slot] for p in segment g (rows
    ``seg_start[g]:seg_start[g + 1]``, slot ``seg_slot[g]``); x [T, K], a [S, R, K], scale [S].
    """
    starts, slots = _host(seg_start), _host(seg_slot)
    s = torch.zeros(rows.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for g, slot in enumerate(slots):
        p0, p1 = starts[g], starts[g + 1]
        xs = x.index_select(0, rows[p0:p1]).float()
        s[p0:p1] = (xs @ a[slot].float().t()) * scale[slot].float()
    return s


def ref_lora_expand(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    seg_start: torch.Tensor | Sequence[int],
    seg_slot: torch.Tensor | Sequence[int],
    shard_cols: Sequence[int],
) -> torch.Tensor:
    """Twin of kvkernels.lora.lora_expand (punica's expand): y plus, in fp32 and rounded once, per grouped row
    p of slot ``slot``: y[rows[p], c] += s[p, j * r:(j + 1) * r] @ b[slot, :, c] for the columns c of
    shard j (``shard_cols[j]:shard_cols[j + 1]``). y [T, N], s [P, shards * r] fp32, b [S, r, N]; returns
    a new tensor in y's dtype."""
    starts, slots, r = _host(seg_start), _host(seg_slot), b.shape[1]
    out = y.float().clone()
    for g, slot in enumerate(slots):
        p0, p1 = starts[g], starts[g + 1]
        parts = [
            s[p0:p1, j * r : (j + 1) * r].float() @ b[slot, :, c0:c1].float()
            for j, (c0, c1) in enumerate(zip(shard_cols, shard_cols[1:], strict=False))
        ]
        out.index_add_(0, rows[p0:p1], torch.cat(parts, dim=1))
    return out.to(y.dtype)
