"""kvferry's bf16 GEMV vs oneDNN's pre-packed bf16 kernel by row count, same run: where PackedLinear's
crossover (BF16_GEMV_ROWS) comes from.

Each timed pass runs distinct copies of a layer, more weight bytes than the caches hold, one after the
other, as a decode step runs its layers: each call streams its weight from memory. Layers: the 12-layer
h768 benchmark Llama's and SmolLM2's.

    python benchmarks/bf16_gemv.py [--rows 1,2,3,4,6,8,16] [--out benchmarks/results/bf16_gemv.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from kvkernels import cpu  # noqa: E402
from services.engine.worker.linear import PackedLinear, bf16_gemv_kernels  # noqa: E402

SHAPES = {  # name: (out features, in features)
    "medium qkv": (1024, 768),
    "medium o": (768, 768),
    "medium gate_up": (4096, 768),
    "medium down": (768, 2048),
    "medium lm_head": (32000, 768),
    "smollm2 qkv": (960, 576),
    "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
}
PASS_BYTES = 128 << 20  # weight bytes per timed pass: more than this VM's last-level cache


def _time(layers: list[PackedLinear], x: torch.Tensor) -> list[float]:
    """Median ms per call of oneDNN's packed kernel and of the GEMV on x, each pass over every copy."""

    def onednn() -> None:
        for layer in layers:
            torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")

    def gemv() -> None:
        for layer in layers:
            layer(x)

    return [ms / len(layers) for ms in median_ms([onednn, gemv], min_reps=7, budget_s=1.5)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bf16_gemv.json"))
    args = ap.parse_args()
    gemv = bf16_gemv_kernels()
    if gemv is None:
        print(f"no bf16 GEMV in this build ({cpu.unavailable_reason() or 'the CPU lacks AVX512_BF16'})")
        return 1
    torch.set_num_threads(os.cpu_count() or 1)
    results = []
    print("| layer | rows | oneDNN packed ms | GEMV ms | GEMV GB/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-PASS_BYTES // (n * k * 2)))
            linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False)
            layers = [PackedLinear(linear, 1 << 30, gemv) for _ in range(copies)]  # GEMV for every row count
            for m in map(int, args.rows.split(",")):
                ms = _time(layers, torch.randn(m, k, dtype=torch.bfloat16))
                row = {"layer": name, "n": n, "k": k, "rows": m, "onednn_ms": ms[0], "gemv_ms": ms[1]}
                row["gemv_GBps"] = n * k * 2 / ms[1] / 1e6
                results.append(row)
                print(f"| {name} | {m} | {ms[0]:.3f} | {ms[1]:.3f} | {row['gemv_GBps']:.1f} | {ms[0] / ms[1]:.2f}x |",
                      flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
