"""TTFT on an engine that lacks a long prompt another engine holds: pulled over NIXL (P2P) vs recomputed.

Two aggregated `kvferry serve` engines, A and B (prefix caching on). For every prompt length and repeat, two
fresh random prompts are computed on A (it holds them); then on B, streaming: the first one with the
kv_transfer_params A's `POST /kv/export` answers (what the router does when `--p2p-min-tokens` says so: the
export call is inside the timing), the second one plain (B recomputes it). TTFT is client-side, from the
first request sent to the first token; greedy outputs of both legs are checked equal to A's. Medians; prints
a table and writes JSON.

    python benchmarks/p2p_pull.py [--model PATH] [--lengths 1024,2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pd_ttft import start  # noqa: E402
from services.common.kv.hashing import HASH_VERSION, BlockHasher  # noqa: E402
from services.common.kv.kv_transfer import EXPORT_PATH  # noqa: E402

BLOCK = 16


def stream(url: str, prompt: list[int], kv: dict | None = None, t0: float | None = None) -> tuple[float, str]:
    """(seconds from ``t0`` to the first token, the greedy text) of one streamed completion."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if kv:
        body["kv_transfer_params"] = kv
    start_t, first, text = t0 or time.perf_counter(), None, ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                    first = first if first is not None else time.perf_counter() - start_t
                    text += choice["text"]
    if first is None:
        raise RuntimeError("no token")
    return first, text


def pulled(holder: str, reader: str, prompt: list[int], hasher: BlockHasher) -> tuple[float, str]:
    """Export on the holder, then the reader's stream with its params; TTFT counts both."""
    t0 = time.perf_counter()
    body = {"block_hashes": [h.hex() for h in hasher.hash_tokens(prompt)]}
    params = httpx.post(f"{holder}{EXPORT_PATH}", json=body, timeout=60)
    params.raise_for_status()
    return stream(reader, prompt, params.json(), t0)


def received_blocks(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'):
            return float(line.split()[-1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 from the model cache")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--result-json", default=str(REPO / "benchmarks" / "results" / "p2p_pull.json"))
    args = ap.parse_args()
    if args.model is None:
        from services.engine.worker.loader.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    common = (
        "--max-model-len",
        "4096",
        "--num-kv-blocks",
        "1024",
        "--block-size",
        str(BLOCK),
        "--dtype",
        "float32",
    )
    procs = [start(args.model, *common) for _ in range(2)]
    (_, a), (_, b) = procs
    hasher = BlockHasher("m", BLOCK, HASH_VERSION)
    try:
        rng, rows = random.Random(0), []
        warm = [rng.randrange(100, 40000) for _ in range(64)]
        stream(a, warm), pulled(a, b, warm, hasher), stream(b, warm[:40])  # warm both paths
        print("| prompt tokens | recompute TTFT p50 | P2P pull TTFT p50 | speed-up | blocks READ |")
        print("|---:|---:|---:|---:|---:|")
        for n in (int(x) for x in args.lengths.split(",")):
            recompute_s, pull_s, same, before = [], [], 0, received_blocks(b)
            for _ in range(args.repeats):
                p, q = ([rng.randrange(100, 40000) for _ in range(n)] for _ in range(2))
                ref_p, ref_q = stream(a, p)[1], stream(a, q)[1]  # A holds both
                s, text_p = pulled(a, b, p, hasher)
                pull_s.append(s)
                s, text_q = stream(b, q)
                recompute_s.append(s)
                same += (text_p == ref_p) + (text_q == ref_q)
            row = {
                "prompt_tokens": n,
                "recompute_ttft_p50_s": statistics.median(recompute_s),
                "p2p_ttft_p50_s": statistics.median(pull_s),
                "blocks_read_per_request": (received_blocks(b) - before) / args.repeats,
                "outputs_equal": f"{same}/{2 * args.repeats}",
            }
            row["speedup"] = row["recompute_ttft_p50_s"] / row["p2p_ttft_p50_s"]
            rows.append(row)
            print(
                f"| {n} | {row['recompute_ttft_p50_s'] * 1e3:.0f} ms | {row['p2p_ttft_p50_s'] * 1e3:.0f} ms"
                f" | {row['speedup']:.1f}x | {row['blocks_read_per_request']:.0f} |  outputs equal {row['outputs_equal']}",
                flush=True,
            )
        meta = {
            "model": args.model,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "command": " ".join(["python benchmarks/p2p_pull.py", *sys.argv[1:]]),
        }
        Path(args.result_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.result_json}")
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
