"""Tier weights from measured load times: per KV block, how long loading it back from each tier (host memory,
local disk, the kvstore) takes against recomputing it (prefill), on the same engine; the router's prefix
scorer then weighs a block held in a tier at ``1 - load / recompute`` (clamped to [0, 1], primary = 1).

Per tier, one engine with that tier and, R times, a fresh prompt of N full blocks (+1 token):
  miss  : its first run (every block recomputed),
  hit   : its second run (every block in the primary pool),
  tier  : after the primary pool is emptied (the host tier: right away; disk: after another prompt pushed
          it from host memory to disk and the files were dropped from the page cache; the kvstore: after
          the engine offloaded it), so every block comes from that tier.
Each is a one-token request's wall time (TTFT); per block, recompute = (miss - hit) / N and load =
(tier - hit) / N (so both carry the scheduler's real overheads: the load waits as a remote-KV request),
each prompt against its own hit, then the median over R. Every run starts with the engine idle (its
tier copies done), so a background store never slows the run measured. Writes benchmarks/results/tier_weights.json; the router's defaults are the figures
committed in services/router/scheduling/tier_weights.py (tests/router/test_tier_weights.py checks them).

    python benchmarks/tier_weights.py [--blocks 32 --reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from services.router.scheduling.tier_weights import TierTiming  # noqa: E402
from tests.kvstore_server import kvstore_process  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
BS = 16


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - t0


def quiesce(llm: LLM, done: Callable[[], bool] = lambda: True, timeout: float = 60.0) -> None:
    """Step the idle engine (it collects finished tier copies) until ``done()`` and no block is held."""
    pool = llm.engine.core.kv_manager.pool
    deadline = time.monotonic() + timeout
    while not (done() and pool.num_free_blocks == pool.num_blocks):
        assert time.monotonic() < deadline, "the engine's tier copies never finished"
        llm.engine.step()
        time.sleep(0.005)


def settle(llm: LLM, done: Callable[[], bool] = lambda: True) -> None:
    """``quiesce``, then empty the primary pool (its cached prefixes forgotten)."""
    quiesce(llm, done)
    assert llm.engine.core.kv_manager.reset_prefix_cache()


def drop_page_cache(folder: Path) -> None:
    """The disk tier's files written out and dropped from the page cache: the next read is from the disk."""
    for path in folder.glob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(llm: LLM, tier: str, blocks: int, reps: int, rng: random.Random, folder: Path | None) -> dict:
    miss, hit, load = [], [], []

    def fresh() -> list[int]:
        return [rng.randrange(10, 49000) for _ in range(blocks * BS + 1)]

    def sent() -> int:
        return llm.engine.core.transfer_stats()[0].get(("sent", "kvstore"), 0)

    for rep in range(reps):
        prompt = fresh()
        miss.append(ttft(llm, prompt))
        want = (rep + 1) * blocks
        quiesce(llm, lambda want=want: tier != "kvstore" or sent() >= want)  # its copies done before the hit
        hit.append(ttft(llm, prompt))
        if tier == "cpu":
            settle(llm)
        elif tier == "disk":  # another prompt's store evicts this one's host slots: demoted to disk
            assert folder is not None
            llm.generate([fresh()], ONE)
            settle(llm, lambda want=want: len(list(folder.glob("*.kvb"))) >= want)
            drop_page_cache(folder)
        else:  # the kvstore: the engine offloaded the prompt's blocks after its first run
            settle(llm)
        load.append(ttft(llm, prompt))
        settle(llm)
    blocks_in, failures = llm.engine.core.transfer_stats()
    m, h, t = (statistics.median(x) * 1e3 for x in (miss, hit, load))
    timing = TierTiming(  # paired per prompt (each against its own hit), then the median
        load_ms_per_block=statistics.median(b - a for a, b in zip(hit, load, strict=True)) * 1e3 / blocks,
        recompute_ms_per_block=statistics.median(b - a for a, b in zip(hit, miss, strict=True))
        * 1e3
        / blocks,
    )
    return {
        "tier": tier,
        "miss_ms": m,
        "hit_ms": h,
        "tier_ms": t,
        "load_ms_per_block": timing.load_ms_per_block,
        "recompute_ms_per_block": timing.recompute_ms_per_block,
        "weight": timing.weight,
        "blocks_received": blocks_in.get(("received", tier), 0),
        "failures": dict(failures),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32, help="full blocks per prompt (16 tokens each)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    model = kvferry_home() / "models" / "SmolLM2-135M-Instruct"
    common = dict(model=str(model), dtype="float32", num_kv_blocks=4 * args.blocks + 8, max_model_len=2048)
    probe = LLM(**common)
    stats = probe.worker_stats()
    per_block = stats.kv_cache_bytes // stats.kv_cache_shape[0]
    probe.shutdown()
    rng = random.Random(0)
    folder = Path(tempfile.mkdtemp(prefix="kvferry-tier-weights-"))
    t0 = time.time()
    rows = []
    with kvstore_process(capacity_gb="1") as store:
        configs = {
            "cpu": {"kv_offload_cpu_bytes": 4 * args.blocks * per_block},
            "disk": {
                "kv_offload_cpu_bytes": args.blocks * per_block,  # one prompt's blocks: the next demotes them
                "kv_offload_disk_path": str(folder),
                "kv_offload_disk_bytes": (args.reps + 2) * args.blocks * (per_block + 4096),
            },
            "kvstore": {"kvstore_url": f"grpc://{store.target}"},
        }
        for tier, extra in configs.items():
            llm = LLM(**common, **extra)
            llm.generate([[11, 12, 13]], ONE)  # warm-up
            rows.append(measure(llm, tier, args.blocks, args.reps, rng, folder if tier == "disk" else None))
            llm.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    print(f"SmolLM2-135M fp32, {args.blocks} blocks of {BS} tokens per prompt, medians of {args.reps}")
    print(
        f"{'tier':<9}{'miss ms':>9}{'hit ms':>8}{'tier ms':>9}{'load/blk':>10}{'recompute/blk':>15}{'weight':>8}"
    )
    for r in rows:
        print(
            f"{r['tier']:<9}{r['miss_ms']:>9.1f}{r['hit_ms']:>8.1f}{r['tier_ms']:>9.1f}"
            f"{r['load_ms_per_block']:>10.2f}{r['recompute_ms_per_block']:>15.2f}{r['weight']:>8.2f}"
        )
    out = ROOT / "benchmarks" / "results" / "tier_weights.json"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "model": "SmolLM2-135M-Instruct fp32 (CPU engine)",
        "block_bytes": per_block,
        "workload": vars(args),
    }
    out.write_text(json.dumps(meta | {"rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
