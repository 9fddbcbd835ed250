"""Host KV tier eviction policies, LRU vs ARC: the share of prompt blocks found in the tier on a trace that
mixes prefixes used again and again (shared system prompts, Zipf popularity) with scans of one-off prompts.

The real HostKVTier (its slots, pins, worker thread and copies) over a small KV tensor, fed the trace the
way the offload connector feeds it: per request, look the prompt's block hashes up (a leading run is a hit),
then store the prompt's blocks (waiting for the copy, so both policies see the same order). No model runs:
what differs is only which block each policy evicts. Writes benchmarks/results/kv_tier_policy.json.

    python benchmarks/kv_tier_policy.py [--slots 256 --requests 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.engine.kv_transfer.host_tier import HostKVTier  # noqa: E402


def trace(args: argparse.Namespace, scan_share: float, seed: int = 0) -> list[list[bytes]]:
    """Per request, its prompt's block hashes: a hot prefix (Zipf over ``--prefixes``) plus a tail of its
    own, or (``scan_share`` of requests) a one-off prompt of ``--scan-blocks`` blocks."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(args.prefixes)]
    out, fresh = [], 0
    for _ in range(args.requests):
        if rng.random() < scan_share:
            blocks = [b"scan%d" % (fresh + i) for i in range(args.scan_blocks)]
            fresh += args.scan_blocks
        else:
            p = rng.choices(range(args.prefixes), weights)[0]
            blocks = [b"p%d-%d" % (p, i) for i in range(args.prefix_blocks)]
            blocks += [b"tail%d" % (fresh + i) for i in range(args.tail_blocks)]
            fresh += args.tail_blocks
        out.append(blocks)
    return out


def replay(requests: list[list[bytes]], slots: int, policy: str) -> dict:
    kv = torch.zeros((64, 256), dtype=torch.float32)  # 1 KiB blocks: the copies are real, and cheap
    tier = HostKVTier(kv, num_slots=slots, queue_depth=64, policy=policy)
    hit = total = 0
    t0 = time.perf_counter()
    try:
        for n, hashes in enumerate(requests):
            found = tier.lookup(hashes)
            tier.unpin(found)
            hit, total = hit + len(found), total + len(hashes)
            blocks = [(n * 7 + i) % 64 for i in range(len(hashes))]
            if tier.store(str(n), blocks, hashes):
                while not tier.finished():
                    time.sleep(0.0001)
    finally:
        tier.close()
    return {"hit_ratio": hit / total, "hit_blocks": hit, "blocks": total, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=256, help="the host tier's blocks")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--prefixes", type=int, default=24, help="shared prefixes (Zipf popularity)")
    ap.add_argument("--prefix-blocks", type=int, default=8)
    ap.add_argument("--tail-blocks", type=int, default=2, help="each request's own blocks after its prefix")
    ap.add_argument("--scan-blocks", type=int, default=32, help="blocks of a one-off prompt")
    args = ap.parse_args()
    rows = []
    for scan_share in (0.0, 0.1, 0.25, 0.5):
        requests = trace(args, scan_share)
        row: dict = {"scan_share": scan_share}
        for policy in ("lru", "arc"):
            r = replay(requests, args.slots, policy)
            row[f"{policy}_hit_ratio"] = round(r["hit_ratio"], 4)
        row["arc_vs_lru"] = round(row["arc_hit_ratio"] / max(row["lru_hit_ratio"], 1e-9), 3)
        rows.append(row)
    print(
        f"host tier of {args.slots} blocks; {args.requests} requests: {args.prefixes} shared prefixes of "
        f"{args.prefix_blocks} blocks (+{args.tail_blocks} own), or a one-off scan of {args.scan_blocks}"
    )
    print(f"{'scan share':>10}{'LRU hits':>10}{'ARC hits':>10}{'ARC/LRU':>9}")
    for r in rows:
        print(
            f"{r['scan_share']:>10.2f}{r['lru_hit_ratio']:>10.3f}{r['arc_hit_ratio']:>10.3f}{r['arc_vs_lru']:>9.2f}"
        )
    out = ROOT / "benchmarks" / "results" / "kv_tier_policy.json"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "workload": vars(args),
    }
    out.write_text(json.dumps(meta | {"rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
