"""The references are the spec: prove them against dense torch SDPA and HF transformers' Llama modules."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import empty_cache, make_paged_kv

from kvkernels.reference import (
    build_cos_sin_cache,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_reshape_and_cache,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch SDPA, causal over the whole dense sequence: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 4])
def test_ref_prefill_equals_dense_causal_sdpa(group: int) -> None:
    """Packed queries = the last q_len rows of full causal attention over each whole dense sequence."""
    seqs = [(1, 1), (23, 23), (40, 11), (9, 1)]
    kv = make_paged_kv([s for s, _ in seqs], 8, 2, 16, torch.float32, "cpu")
    full_q = [torch.randn(s, 2 * group, 16) for s, _ in seqs]
    query = torch.cat([fq[s - q :] for fq, (s, q) in zip(full_q, seqs, strict=True)])
    qsl = torch.tensor([0] + [q for _, q in seqs]).cumsum(0).to(torch.int32)
    out = ref_paged_prefill_attention(
        query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.25
    )
    dense = [
        dense_causal(fq, k, v, 0.25)[s - q :]
        for fq, k, v, (s, q) in zip(full_q, kv.keys, kv.values, seqs, strict=True)
    ]
    torch.testing.assert_close(out, torch.cat(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_decode_equals_sdpa_and_prefill_with_one_query(dtype: torch.dtype) -> None:
    """Decode = SDPA of the query over the gathered dense K/V = prefill with q_len 1."""
    kv = make_paged_kv([1, 17, 40], 16, 2, 16, dtype, "cpu")
    query = torch.randn(3, 8, 16, dtype=dtype)
    out = ref_paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.3)
    for b, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
        sdpa = F.scaled_dot_product_attention(
            query[b, :, None].float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            scale=0.3,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out[b], sdpa.to(dtype))
    qsl = torch.arange(4, dtype=torch.int32)
    prefill = ref_paged_prefill_attention(
        query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.3
    )
    assert torch.equal(out, prefill)


def test_ref_reshape_and_cache_writes_each_slot() -> None:
    cache, key_cache, value_cache = empty_cache(3, 4, 2, 8, torch.float32, "cpu")
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([6, -1, 0, 11, 3])
    ref_reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache[slot // 4, 1, 0, slot % 4], key[t])
            assert torch.equal(cache[slot // 4, 1, 1, slot % 4], value[t])
    assert int((~cache.isnan()).sum()) == 4 * 2 * 2 * 8
    assert cache[:, [0, 2]].isnan().all()


ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


@pytest.mark.parametrize("rope_scaling", ROPE_CASES)
def test_cos_sin_cache_equals_hf_llama_rotary_embedding(rope_scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})}
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=params,
    )
    positions = torch.tensor([[0, 1, 2, 1000, 8191, 8192, 50000, 131071]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cache = build_cos_sin_cache(128, 131072, 500000.0, rope_scaling, torch.float32)[positions[0]]
    assert torch.equal(cache[:, :64], cos[0, :, :64]) and torch.equal(cache[:, :64], cos[0, :, 64:])
    assert torch.equal(cache[:, 64:], sin[0, :, :64]) and torch.equal(cache[:, 64:], sin[0, :, 64:])


def test_cos_sin_cache_rejects_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="yarn"):
        build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0}, torch.float32)


def test_ref_rotary_equals_hf_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cache = build_cos_sin_cache(32, 512, 10000.0, None, torch.float32)
    positions = torch.randint(0, 512, (7,))
    query, key = torch.randn(7, 8, 32), torch.randn(7, 2, 32)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    q, k = ref_rotary_embedding(positions, query, key, cache, is_neox=True)
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_ref_rotary_gptj_pairs() -> None:
    """Non-neox rotates interleaved pairs (x[2i], x[2i+1]) by angle pos * inv_freq[i]."""
    cache = build_cos_sin_cache(4, 8, 10000.0, None, torch.float32)
    x = torch.randn(1, 1, 4)
    q, _ = ref_rotary_embedding(torch.tensor([5]), x, x, cache, is_neox=False)
    angles = 5 / 10000.0 ** (torch.arange(0, 4, 2) / 4)
    pairs = torch.view_as_complex(x.view(2, 2).contiguous()) * torch.polar(torch.ones(2), angles)
    torch.testing.assert_close(q.view(2, 2), torch.view_as_real(pairs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ref_rms_norm_equals_hf_llama_rms_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x, residual = torch.randn(9, 64, dtype=dtype), torch.randn(9, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ref_rms_norm(x, norm.weight, 1e-5), norm(x))
        out, r = ref_rms_norm(x, norm.weight, 1e-5, residual)
        assert torch.equal(r, x + residual) and torch.equal(out, norm(x + residual))


def test_ref_silu_and_mul_equals_hf_activation() -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 24)
    assert torch.equal(ref_silu_and_mul(x), ACT2FN["silu"](x[:, :24]) * x[:, 24:])


@pytest.mark.parametrize("window", [0, 5])
def test_ref_sinks_equal_hf_gpt_oss_eager_attention(window: int) -> None:
    """The sink semantics of the references are HF transformers' gpt-oss eager attention: softmax over
    [scores, sink] per head, the sink's column dropped (dense causal, sliding-window mask)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seq, hkv, group, d = 23, 2, 3, 16
    kv = make_paged_kv([seq], 8, hkv, d, torch.float32, "cpu")
    query = torch.randn(seq, hkv * group, d)
    sinks = torch.randn(hkv * group) * 2
    qsl = torch.tensor([0, seq], dtype=torch.int32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, 0.25)
    out = ref_paged_prefill_attention(*args, window=window, sinks=sinks)
    pos = torch.arange(seq)
    hidden = pos[None, :] > pos[:, None]
    if window:
        hidden |= pos[None, :] <= pos[:, None] - window
    mask = torch.zeros(seq, seq).masked_fill(hidden, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=group, sinks=sinks, training=False)
    k, v = (c.transpose(0, 1)[None] for c in (kv.keys[0], kv.values[0]))
    hf, _ = eager_attention_forward(module, query.transpose(0, 1)[None], k, v, mask, scaling=0.25)
    torch.testing.assert_close(out, hf[0], rtol=1e-5, atol=1e-6)
    decode = ref_paged_decode_attention(
        query[-1:],
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.seq_lens,
        0.25,
        window=window,
        sinks=sinks,
    )
    torch.testing.assert_close(decode, hf[0, -1:], rtol=1e-5, atol=1e-6)
