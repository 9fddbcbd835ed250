"""GPU benchmark of the Triton kernels: paged decode bytes/s vs copy bandwidth, prefill TFLOP/s vs SDPA."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/kernels.py`: this file's folder must not shadow the `kernels` package (Hugging Face's, which transformers imports).
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import torch  # noqa: E402

from benchmarks.kernel_rows import (  # noqa: E402
    Shapes,
    bench_ms,
    copy_bandwidth,
    decode_step_row,
    pointwise_rows,
    random_model,
)

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
# Llama-3-8B attention shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks.
FULL = Shapes(
    device="cuda",
    dtype=torch.bfloat16,
    hq=32,
    hkv=8,
    head_dim=128,
    block_size=16,
    decode_batches=(1, 16, 64, 256),
    decode_contexts=(512, 4096, 32768),
    prefill_problems=((1, 0, 1024), (4, 0, 4096), (1, 0, 16384), (8, 8192, 512)),
    pointwise_tokens=(256, 8192),
    hidden=4096,
    intermediate=14336,
    model=LLAMA3_8B,
    step_batches=(1, 16, 64),
    step_contexts=(512, 4096),
)
QUICK = dataclasses.replace(
    FULL, prefill_problems=((1, 0, 1024), (4, 0, 4096)), step_batches=(1, 64), step_contexts=(512,)
)
TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
}
# Tiny shapes for the CPU interpreter: proves every row runs end to end (the numbers mean nothing).
SMOKE = Shapes(
    device="cpu",
    dtype=torch.float32,
    hq=4,
    hkv=2,
    head_dim=16,
    block_size=4,
    decode_batches=(1, 2),
    decode_contexts=(9,),
    prefill_problems=((2, 5, 3),),
    pointwise_tokens=(5,),
    hidden=32,
    intermediate=48,
    model=TINY_LLAMA,
    step_batches=(2,),
    step_contexts=(7,),
)


def paged_cache(sh: Shapes, num_tokens_per_seq: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer block-major cache holding the sequences in shuffled blocks, and their block tables."""
    blocks = [-(-n // sh.block_size) for n in num_tokens_per_seq]
    cache = torch.empty(
        sum(blocks), 1, 2, sh.block_size, sh.hkv, sh.head_dim, dtype=sh.dtype, device=sh.device
    )
    cache.normal_()
    order = torch.randperm(sum(blocks), device=sh.device, dtype=torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=sh.device)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start : start + n]
        start += n
    return cache, cache[:, 0, 0], tables


def decode_row(sh: Shapes, batch: int, context: int, copy_bw: float) -> dict:
    """Bytes it must move: K and V of every context token once, plus q/out; FLOPs: 4 * ctx * Hq * D."""
    from kvkernels.paged_decode_attention import paged_decode_attention

    kv_bytes = 2 * batch * context * sh.hkv * sh.head_dim * sh.dtype.itemsize
    if sh.device == "cuda" and kv_bytes > 0.6 * torch.cuda.mem_get_info()[0]:
        return {"kernel": "decode", "batch": batch, "context": context, "skipped": "KV does not fit"}
    cache, key_cache, tables = paged_cache(sh, [context] * batch)
    value_cache = cache[:, 0, 1]
    query = torch.randn(batch, sh.hq, sh.head_dim, dtype=sh.dtype, device=sh.device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=sh.device)
    ms = bench_ms(
        sh,
        lambda: paged_decode_attention(
            query, key_cache, value_cache, tables, seq_lens, sh.head_dim**-0.5, max_seq_len=context
        ),
    )
    total_bytes = kv_bytes + 2 * query.numel() * sh.dtype.itemsize + tables.numel() * 4
    flops = 4 * batch * context * sh.hq * sh.head_dim
    bw = total_bytes / (ms * 1e-3)
    return {
        "kernel": "decode",
        "batch": batch,
        "context": context,
        "ms": ms,
        "bytes": total_bytes,
        "flops": flops,
        "bytes_per_s": bw,
        "fraction_of_copy_bw": bw / copy_bw,
        "limit": "DRAM bandwidth (KV read once); launch latency when KV is small",
    }


def causal_flops(sh: Shapes, batch: int, prefix: int, q_len: int) -> int:
    """4 * Hq * D * (number of (query, key) pairs under the causal mask with a cached prefix)."""
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    return 4 * batch * sh.hq * sh.head_dim * pairs


def prefill_row(sh: Shapes, batch: int, prefix: int, q_len: int) -> dict:
    """Paged prefill vs torch SDPA on the same dense problem (K/V expanded to Hq heads for SDPA)."""
    from kvkernels.paged_prefill_attention import paged_prefill_attention

    seq_len, dev, scale = prefix + q_len, sh.device, sh.head_dim**-0.5
    cache, key_cache, tables = paged_cache(sh, [seq_len] * batch)
    value_cache = cache[:, 0, 1]
    query = torch.randn(batch * q_len, sh.hq, sh.head_dim, dtype=sh.dtype, device=dev)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    ms = bench_ms(
        sh,
        lambda: paged_prefill_attention(
            query, key_cache, value_cache, tables, qsl, seq_lens, scale, max_query_len=q_len
        ),
    )
    q = query.view(batch, q_len, sh.hq, sh.head_dim).transpose(1, 2)
    k = torch.randn(batch, sh.hq, seq_len, sh.head_dim, dtype=sh.dtype, device=dev)
    mask = None
    if prefix:  # bottom-right aligned causal mask; SDPA's is_causal is top-left aligned
        pos = torch.arange(seq_len, device=dev)
        mask = pos[None, :] <= pos[prefix:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = bench_ms(sh, lambda: sdpa(q, k, k, attn_mask=mask, is_causal=mask is None, scale=scale))
    flops = causal_flops(sh, batch, prefix, q_len)
    kv_bytes = 2 * batch * seq_len * sh.hkv * sh.head_dim * sh.dtype.itemsize
    return {
        "kernel": "prefill",
        "batch": batch,
        "prefix": prefix,
        "q_len": q_len,
        "ms": ms,
        "sdpa_ms": sdpa_ms,
        "flops": flops,
        "bytes": kv_bytes + 2 * query.numel() * sh.dtype.itemsize,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
        "limit": "tensor-core throughput (compute bound at these lengths)",
    }


def print_attention(sh: Shapes, copy_bw: float, rows: list[dict]) -> None:
    """Tables of the decode and prefill attention rows."""
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(
        f"\npaged decode attention (Hq={sh.hq}, Hkv={sh.hkv}, D={sh.head_dim}, {sh.dtype}, block {sh.block_size})"
    )
    print(f"{'batch':>6} {'context':>8} {'ms':>9} {'MB moved':>10} {'GFLOP':>8} {'GB/s':>8} {'% copy':>7}")
    for r in (r for r in rows if r["kernel"] == "decode"):
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>6} {r['context']:>8} {r['ms']:>9.4f} {r['bytes'] / 1e6:>10.1f} {r['flops'] / 1e9:>8.2f} "
            f"{r['bytes_per_s'] / 1e9:>8.0f} {100 * r['fraction_of_copy_bw']:>6.1f}%"
        )
    print("\npaged prefill attention vs torch SDPA (same dense problem, causal)")
    print(
        f"{'batch':>6} {'prefix':>7} {'q_len':>6} {'ms':>9} {'TFLOP/s':>8} {'SDPA ms':>9} {'SDPA TFLOP/s':>13}"
    )
    for r in (r for r in rows if r["kernel"] == "prefill"):
        print(
            f"{r['batch']:>6} {r['prefix']:>7} {r['q_len']:>6} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
            f"{r['sdpa_ms']:>9.3f} {r['sdpa_tflops']:>13.1f}"
        )


def print_pointwise_and_steps(rows: list[dict]) -> None:
    """Tables of the pointwise kernels (vs their torch references) and the end-to-end decode steps."""
    print("\npointwise kernels vs their torch reference (kvkernels/reference.py)")
    print(
        f"{'kernel':>18} {'tokens':>7} {'ms':>9} {'MB moved':>9} {'GB/s':>7} {'% copy':>7} {'torch ms':>9} {'x':>6}"
    )
    for r in (r for r in rows if "tokens" in r):
        print(
            f"{r['kernel']:>18} {r['tokens']:>7} {r['ms']:>9.4f} {r['bytes'] / 1e6:>9.2f} "
            f"{r['bytes_per_s'] / 1e9:>7.0f} {100 * r['fraction_of_copy_bw']:>6.1f}% {r['torch_ms']:>9.4f} "
            f"{r['speedup_vs_torch']:>6.2f}"
        )
    print(
        "\nend-to-end decode step (all layers + logits, Triton backend) vs floor = (weights + KV) / copy bandwidth"
    )
    print(
        f"{'batch':>6} {'context':>8} {'ms':>9} {'floor ms':>9} {'% floor':>8} {'weights GB':>11} {'KV GB':>7}"
    )
    for r in (r for r in rows if r["kernel"] == "decode_step"):
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>6} {r['context']:>8} {r['ms']:>9.3f} {r['floor_ms']:>9.3f} "
            f"{100 * r['fraction_of_floor']:>7.1f}% {r['weight_bytes'] / 1e9:>11.2f} {r['kv_bytes'] / 1e9:>7.3f}"
        )


def run(sh: Shapes) -> tuple[float, list[dict]]:
    """Measure every row: attention, pointwise kernels, then end-to-end decode steps."""
    from services.engine.worker.attention import select_backend

    torch.manual_seed(0)
    copy_bw = copy_bandwidth(sh)
    rows = [decode_row(sh, b, c, copy_bw) for b in sh.decode_batches for c in sh.decode_contexts]
    rows += [prefill_row(sh, *problem) for problem in sh.prefill_problems]
    rows += [r for t in sh.pointwise_tokens for r in pointwise_rows(sh, t, copy_bw)]
    model, backend = random_model(sh), select_backend(torch.device(sh.device), "triton")
    rows += [
        decode_step_row(sh, model, backend, b, c, copy_bw) for b in sh.step_batches for c in sh.step_contexts
    ]
    return copy_bw, rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on CUDA (or --smoke on CPU), print tables, write benchmarks/results/kernels-<device>.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1: checks every row runs, numbers mean nothing",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the GPU check's cut: every decode cell, two prefill problems, two decode-step cells",
    )
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py: no CUDA device here; the Triton kernel benchmark needs a GPU "
            "(--smoke runs tiny shapes in the interpreter). Skipped."
        )
        return 0
    sh = SMOKE if args.smoke else QUICK if args.quick else FULL
    copy_bw, rows = run(sh)
    print_attention(sh, copy_bw, rows)
    print_pointwise_and_steps(rows)
    name = "cpu-smoke" if args.smoke else torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"kernels-{slug}.json"
    meta = {
        "device": name,
        "torch": torch.__version__,
        "copy_bytes_per_s": copy_bw,
        "shapes": {
            "hq": sh.hq,
            "hkv": sh.hkv,
            "head_dim": sh.head_dim,
            "block_size": sh.block_size,
            "dtype": str(sh.dtype),
            "model": sh.model,
        },
    }
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
