"""GPU benchmark of the Triton kernels: paged decode bytes/s vs copy bandwidth, prefill TFLOP/s vs SDPA."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/kernels.py`: this file's folder must not shadow the `kernels` package.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import torch  # noqa: E402

# Llama-3-8B attention shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks.
DEVICE = "cuda"
HQ, HKV, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DECODE_BATCHES, DECODE_CONTEXTS = (1, 16, 64, 256), (512, 4096, 32768)
# (batch, cached prefix, new query tokens) per prefill problem.
PREFILL_PROBLEMS = ((1, 0, 1024), (4, 0, 4096), (1, 0, 16384), (8, 8192, 512))


def bench_ms(fn: object) -> float:
    """Median milliseconds of fn() with the L2 cache flushed between runs (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy bytes/s (read + write) of a 1 GiB buffer: the practical DRAM ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def paged_cache(num_tokens_per_seq: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer block-major cache holding the sequences in shuffled blocks, and their block tables."""
    blocks = [-(-n // BLOCK_SIZE) for n in num_tokens_per_seq]
    cache = torch.empty(sum(blocks), 1, 2, BLOCK_SIZE, HKV, HEAD_DIM, dtype=DTYPE, device=DEVICE).normal_()
    order = torch.randperm(sum(blocks), device=DEVICE, dtype=torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start : start + n]
        start += n
    return cache, cache[:, 0, 0], tables


def decode_row(batch: int, context: int, copy_bw: float) -> dict:
    """Bytes it must move: K and V of every context token once, plus q/out; FLOPs: 4 * ctx * Hq * D."""
    from kernels.paged_decode_attention import paged_decode_attention

    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * DTYPE.itemsize
    if kv_bytes > 0.6 * torch.cuda.mem_get_info()[0]:
        return {"kernel": "decode", "batch": batch, "context": context, "skipped": "KV does not fit"}
    cache, key_cache, tables = paged_cache([context] * batch)
    value_cache = cache[:, 0, 1]
    query = torch.randn(batch, HQ, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    ms = bench_ms(lambda: paged_decode_attention(query, key_cache, value_cache, tables, seq_lens,
                                                 HEAD_DIM**-0.5, max_seq_len=context))
    total_bytes = kv_bytes + 2 * query.numel() * DTYPE.itemsize + tables.numel() * 4
    flops = 4 * batch * context * HQ * HEAD_DIM
    bw = total_bytes / (ms * 1e-3)
    return {"kernel": "decode", "batch": batch, "context": context, "ms": ms, "bytes": total_bytes,
            "flops": flops, "bytes_per_s": bw, "fraction_of_copy_bw": bw / copy_bw,
            "limit": "DRAM bandwidth (KV read once); launch latency when KV is small"}


def causal_flops(batch: int, prefix: int, q_len: int) -> int:
    """4 * Hq * D * (number of (query, key) pairs under the causal mask with a cached prefix)."""
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    return 4 * batch * HQ * HEAD_DIM * pairs


def prefill_row(batch: int, prefix: int, q_len: int) -> dict:
    """Paged prefill vs torch SDPA on the same dense problem (K/V expanded to Hq heads for SDPA)."""
    from kernels.paged_prefill_attention import paged_prefill_attention

    seq_len = prefix + q_len
    cache, key_cache, tables = paged_cache([seq_len] * batch)
    value_cache = cache[:, 0, 1]
    query = torch.randn(batch * q_len, HQ, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    ms = bench_ms(lambda: paged_prefill_attention(query, key_cache, value_cache, tables, qsl, seq_lens,
                                                  HEAD_DIM**-0.5, max_query_len=q_len))
    q = query.view(batch, q_len, HQ, HEAD_DIM).transpose(1, 2)
    k = torch.randn(batch, HQ, seq_len, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    mask = None
    if prefix:  # bottom-right aligned causal mask; SDPA's is_causal is top-left aligned
        pos = torch.arange(seq_len, device=DEVICE)
        mask = pos[None, :] <= pos[prefix:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = bench_ms(lambda: sdpa(q, k, k, attn_mask=mask, is_causal=mask is None, scale=HEAD_DIM**-0.5))
    flops = causal_flops(batch, prefix, q_len)
    kv_bytes = 2 * batch * seq_len * HKV * HEAD_DIM * DTYPE.itemsize
    return {"kernel": "prefill", "batch": batch, "prefix": prefix, "q_len": q_len, "ms": ms, "sdpa_ms": sdpa_ms,
            "flops": flops, "bytes": kv_bytes + 2 * query.numel() * DTYPE.itemsize,
            "tflops": flops / (ms * 1e-3) / 1e12, "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
            "limit": "tensor-core throughput (compute bound at these lengths)"}


def print_tables(copy_bw: float, rows: list[dict]) -> None:
    """Human-readable tables of the decode and prefill rows."""
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"\npaged decode attention (Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, {DTYPE}, block {BLOCK_SIZE})")
    print(f"{'batch':>6} {'context':>8} {'ms':>9} {'MB moved':>10} {'GFLOP':>8} {'GB/s':>8} {'% copy':>7}")
    for r in (r for r in rows if r["kernel"] == "decode"):
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>6} {r['context']:>8} {r['ms']:>9.4f} {r['bytes'] / 1e6:>10.1f} {r['flops'] / 1e9:>8.2f} "
              f"{r['bytes_per_s'] / 1e9:>8.0f} {100 * r['fraction_of_copy_bw']:>6.1f}%")
    print("\npaged prefill attention vs torch SDPA (same dense problem, causal)")
    print(f"{'batch':>6} {'prefix':>7} {'q_len':>6} {'ms':>9} {'TFLOP/s':>8} {'SDPA ms':>9} {'SDPA TFLOP/s':>13}")
    for r in (r for r in rows if r["kernel"] == "prefill"):
        print(f"{r['batch']:>6} {r['prefix']:>7} {r['q_len']:>6} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['sdpa_ms']:>9.3f} {r['sdpa_tflops']:>13.1f}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on CUDA, print tables, write benchmarks/results/kernels-<device>.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device here; the Triton kernel benchmark needs a GPU. Skipped.")
        return 0
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    rows = [decode_row(b, c, copy_bw) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    rows += [prefill_row(*problem) for problem in PREFILL_PROBLEMS]
    print_tables(copy_bw, rows)
    name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"kernels-{slug}.json"
    meta = {"device": name, "torch": torch.__version__, "copy_bytes_per_s": copy_bw,
            "shapes": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": str(DTYPE)}}
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
