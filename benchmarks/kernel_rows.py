"""Rows of the kernel benchmark: each measures one problem and states the bytes and FLOPs it must cost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Shapes:
    """Every size the benchmark uses; FULL is a Llama-3-8B-like GPU run, SMOKE a tiny interpreted one."""

    device: str
    dtype: torch.dtype
    hq: int
    hkv: int
    head_dim: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_problems: tuple[tuple[int, int, int], ...]  # (batch, cached prefix, new query tokens)
    pointwise_tokens: tuple[int, ...]  # a decode batch and a prefill chunk
    hidden: int
    intermediate: int
    model: dict = field(default_factory=dict)  # ModelConfig fields of the end-to-end decode-step model
    step_batches: tuple[int, ...] = ()
    step_contexts: tuple[int, ...] = ()


def bench_ms(shapes: Shapes, fn: Callable[[], object]) -> float:
    """Median milliseconds of fn(): triton's do_bench (L2 flushed between runs) on CUDA, a plain timer on CPU."""
    if shapes.device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(shapes: Shapes) -> float:
    """Device-to-device copy bytes/s (read + write) of a large buffer: the practical DRAM ceiling."""
    n = 2**30 if shapes.device == "cuda" else 2**24
    src = torch.empty(n, dtype=torch.uint8, device=shapes.device)
    dst = torch.empty_like(src)
    ms = bench_ms(shapes, lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


def _timed_row(
    shapes: Shapes,
    kernel: str,
    tokens: int,
    fn: Callable,
    ref: Callable,
    nbytes: int,
    flops: int,
    copy_bw: float,
) -> dict:
    """A pointwise row: kernel vs its torch reference, bytes/s as a fraction of copy bandwidth."""
    ms, ref_ms = bench_ms(shapes, fn), bench_ms(shapes, ref)
    bw = nbytes / (ms * 1e-3)
    return {
        "kernel": kernel,
        "tokens": tokens,
        "ms": ms,
        "torch_ms": ref_ms,
        "bytes": nbytes,
        "flops": flops,
        "bytes_per_s": bw,
        "fraction_of_copy_bw": bw / copy_bw,
        "speedup_vs_torch": ref_ms / ms,
        "limit": "DRAM bandwidth (one read and one write of each element)",
    }


def pointwise_rows(shapes: Shapes, tokens: int, copy_bw: float) -> list[dict]:
    """Fused RMSNorm+residual, rotary, SiLU-and-mul and the cache write on `tokens` rows."""
    from kvkernels import reference as ref
    from kvkernels.activation import silu_and_mul
    from kvkernels.reshape_and_cache import reshape_and_cache
    from kvkernels.rms_norm import rms_norm
    from kvkernels.rotary import rotary_embedding

    dev, dt, es = shapes.device, shapes.dtype, shapes.dtype.itemsize
    h, inter, hq, hkv, d = shapes.hidden, shapes.intermediate, shapes.hq, shapes.hkv, shapes.head_dim
    x, res = torch.randn(tokens, h, dtype=dt, device=dev), torch.randn(tokens, h, dtype=dt, device=dev)
    w = torch.rand(h, dtype=dt, device=dev)
    rows = [
        _timed_row(
            shapes,
            "rms_norm+residual",
            tokens,
            lambda: rms_norm(x, w, 1e-5, res),
            lambda: ref.ref_rms_norm(x, w, 1e-5, res),
            (4 * tokens * h + h) * es,
            5 * tokens * h,
            copy_bw,
        )
    ]
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    cache = ref.build_cos_sin_cache(d, 8192, 500000.0, None, dt).to(dev)
    q, k = torch.randn(tokens, hq, d, dtype=dt, device=dev), torch.randn(tokens, hkv, d, dtype=dt, device=dev)
    qk = (hq + hkv) * d
    rows.append(
        _timed_row(
            shapes,
            "rotary",
            tokens,
            lambda: rotary_embedding(pos, q, k, cache),
            lambda: ref.ref_rotary_embedding(pos, q, k, cache, True),
            (2 * tokens * qk + 2 * tokens * d) * es,
            3 * tokens * qk,
            copy_bw,
        )
    )
    gate_up = torch.randn(tokens, 2 * inter, dtype=dt, device=dev)
    rows.append(
        _timed_row(
            shapes,
            "silu_and_mul",
            tokens,
            lambda: silu_and_mul(gate_up),
            lambda: ref.ref_silu_and_mul(gate_up),
            3 * tokens * inter * es,
            6 * tokens * inter,
            copy_bw,
        )
    )
    num_blocks = -(-tokens // shapes.block_size)
    kv = torch.zeros(num_blocks, 1, 2, shapes.block_size, hkv, d, dtype=dt, device=dev)
    slots = torch.randperm(num_blocks * shapes.block_size, device=dev)[:tokens]
    kk, vv = (
        torch.randn(tokens, hkv, d, dtype=dt, device=dev),
        torch.randn(tokens, hkv, d, dtype=dt, device=dev),
    )
    rows.append(
        _timed_row(
            shapes,
            "reshape_and_cache",
            tokens,
            lambda: reshape_and_cache(kk, vv, kv[:, 0, 0], kv[:, 0, 1], slots),
            lambda: ref.ref_reshape_and_cache(kk, vv, kv[:, 0, 0], kv[:, 0, 1], slots),
            4 * tokens * hkv * d * es + 8 * tokens,
            0,
            copy_bw,
        )
    )
    return rows


def random_model(shapes: Shapes) -> torch.nn.Module:
    """The engine's Llama with random weights (std 0.02, norms 1) of the shape shapes.model describes."""
    from services.engine.worker.model_config import ModelConfig
    from services.engine.worker.models import get_model_class

    cfg = ModelConfig(architecture="LlamaForCausalLM", **shapes.model)
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, cfg.max_position_embeddings, shapes.dtype)
    model = model.to_empty(device=shapes.device).to(shapes.dtype)
    model.cos_sin_cache = model.build_rope_cache(shapes.dtype).to(shapes.device)
    for name, p in model.named_parameters():
        p.data.fill_(1.0) if name.endswith("norm.weight") else p.data.normal_(0.0, 0.02)
    return model.eval()


def weight_bytes_read(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights one decode step reads: every matrix once, only `batch` rows of the embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    return (
        total
        if tied
        else total - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()
    )


def decode_step_row(
    shapes: Shapes, model: torch.nn.Module, backend: object, batch: int, context: int, copy_bw: float
) -> dict:
    """One engine decode step (all layers + logits) of `batch` sequences at `context` vs its bandwidth floor."""
    from services.engine.worker.model_runner import kv_cache_shape

    cfg, bs = model.cfg, shapes.block_size
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * shapes.dtype.itemsize
    kv_bytes = batch * (context + 1) * kv_per_token
    if shapes.device == "cuda" and kv_bytes > 0.6 * torch.cuda.mem_get_info()[0]:
        return {"kernel": "decode_step", "batch": batch, "context": context, "skipped": "KV does not fit"}
    per_seq = -(-(context + 1) // bs)
    kv_cache = torch.empty(kv_cache_shape(cfg, batch * per_seq, bs), dtype=shapes.dtype, device=shapes.device)
    kv_cache.normal_()
    order = torch.randperm(batch * per_seq).view(batch, per_seq).tolist()
    slots = [blocks[context // bs] * bs + context % bs for blocks in order]
    meta = backend.build_metadata(
        [1] * batch, [context + 1] * batch, order, slots, bs, torch.device(shapes.device)
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=shapes.device)
    pos = torch.full((batch,), context, dtype=torch.long, device=shapes.device)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, kv_cache, meta, backend))

    ms = bench_ms(shapes, step)
    w_bytes = weight_bytes_read(model, batch)
    floor_ms = (w_bytes + kv_bytes) / copy_bw * 1e3
    return {
        "kernel": "decode_step",
        "batch": batch,
        "context": context,
        "ms": ms,
        "floor_ms": floor_ms,
        "fraction_of_floor": floor_ms / ms,
        "weight_bytes": w_bytes,
        "kv_bytes": kv_bytes,
        "flops": 2 * batch * w_bytes // shapes.dtype.itemsize
        + 4 * batch * context * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers,
        "limit": "weight + KV bytes over DRAM bandwidth; eager launches (~10 per layer) at small batch",
    }
