"""Sampler cost per step by batch size: one batched pass vs the per-row reference (a loop of one-row calls).

Prints a table and writes benchmarks/results/sampler.json. The batched sampler should cost far less than
B one-row calls at B=256 (the loop is what the sampler did per row before it was batched).
Usage: python benchmarks/sampler.py [--vocab 49152] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import median_ms  # noqa: E402
from services.engine.core.sampling_params import SamplingParams  # noqa: E402
from services.engine.worker.sampler import Sampler, SamplingRow  # noqa: E402

PARAMS = {
    "temperature": SamplingParams(temperature=0.8),
    "top-p+top-k+penalties+seed": SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.3, seed=1
    ),
}


def _rows(params: SamplingParams, n: int) -> list[SamplingRow]:
    return [SamplingRow(params, list(range(64)), list(range(i % 32)), (2,)) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,16,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    sampler, results = Sampler(), []
    print(f"{'params':30} {'rows':>5} {'batched ms':>11} {'per-row loop ms':>16} {'ratio':>6}")
    for name, params in PARAMS.items():
        for b in (int(x) for x in args.batches.split(",")):
            logits = torch.randn(b, args.vocab, device=args.device)
            rows = _rows(params, b)
            batched, looped = median_ms(
                [
                    lambda logits=logits, rows=rows: sampler(logits, rows),
                    lambda logits=logits, rows=rows, b=b: [
                        sampler(logits[i : i + 1], rows[i : i + 1]) for i in range(b)
                    ],
                ],
                min_reps=3,
                budget_s=2.0,
            )
            results.append({"params": name, "rows": b, "batched_ms": batched, "loop_ms": looped})
            print(f"{name:30} {b:5d} {batched:11.2f} {looped:16.2f} {looped / batched:6.1f}x")
    out = Path(__file__).parent / "results" / "sampler.json"
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "device": args.device, "vocab": args.vocab, "command": "python benchmarks/sampler.py"}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
