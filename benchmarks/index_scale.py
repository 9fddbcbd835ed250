"""The Redis prefix index at 10, 100 and 1,000 engines: lookup latency of today's holder-set walk against the
previous per-engine scan (kept as a reference in tests/common/prefix_index_v1.py), on the same index.

Per fleet size, one real redis-server; every engine writes --blocks block hashes in numbered batches of 16
through the engines' own APPLY script (which keeps the forward sets the old lookup reads and the holder
sets the new one walks: both answer from the same data, and every answer is checked equal). Then 100-block
prompts are looked up, alternating old and new, in two shapes: ``unique`` (one engine holds the prompt)
and ``shared_prefix`` (every engine holds the first 16 blocks, one engine the rest: the walk's worst case
is many holders). Also the write rate the fill reached (block events/s, one client), and the same fill
written by the previous version's APPLY script into a second redis-server (what the holder sets cost).
Writes benchmarks/results/index_scale.json.
Usage: python benchmarks/index_scale.py [--sizes 10,100,1000] [--blocks 256] [--lookups 100]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.kv.kv_events import AllBlocksCleared, BlockStored, KVEvent  # noqa: E402
from services.common.kv.prefix_index import EngineRef, IndexSettings, PrefixIndex, PrefixMatch  # noqa: E402
from services.sim.redis_process import RedisProcess  # noqa: E402
from services.sim.sim_report import percentiles  # noqa: E402
from tests.common.prefix_index_v1 import apply_v1, lookup_v1  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "index_scale.json"
SETTINGS = IndexSettings(heartbeat_ttl_s=3600.0, reap_after_s=7200.0)  # nobody expires during the run
SHARED = 16  # blocks of the shared prefix (a system prompt every engine holds)


def block(engine: int, j: int) -> bytes:
    return hashlib.sha256(f"{engine}:{j}".encode()).digest()


def fill(write: Callable[[EngineRef, int, list[KVEvent], bool], object], engines: int, blocks: int) -> float:
    """Every engine stores the shared prefix and then its own blocks, 16 per batch; returns events/s."""
    shared = [hashlib.sha256(f"shared:{j}".encode()).digest() for j in range(SHARED)]
    refs = [EngineRef(f"e{i}", "x", f"http://sim/e{i}") for i in range(engines)]
    t0, events = time.perf_counter(), 0
    for i, ref in enumerate(refs):
        write(ref, 0, [AllBlocksCleared("gpu"), BlockStored(tuple(shared), None, (), 16)], True)
        own = [block(i, j) for j in range(blocks - SHARED)]
        for seq, s in enumerate(range(0, len(own), 16), start=1):
            write(ref, seq, [BlockStored(tuple(own[s : s + 16]), None, (), 16)], False)
        events += blocks
    return events / (time.perf_counter() - t0)


def previous_fill(engines: int, blocks: int) -> float:
    """The same fill written by the previous version's APPLY script (forward sets only)."""
    with RedisProcess() as url:
        client = redis.Redis.from_url(url, socket_timeout=30)
        rate = fill(
            lambda ref, seq, evs, force: apply_v1(client, SETTINGS, ref, seq, evs, force), engines, blocks
        )
        client.close()
        return rate


def timed(fn: Callable[[], dict[str, PrefixMatch] | None]) -> tuple[float, dict[str, PrefixMatch] | None]:
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def one_size(engines: int, blocks: int, lookups: int) -> dict:
    previous = previous_fill(engines, blocks)
    with RedisProcess() as url:
        client = redis.Redis.from_url(url, socket_timeout=30)
        index = PrefixIndex(client, SETTINGS)
        events_per_s = fill(index.apply, engines, blocks)
        shared = [hashlib.sha256(f"shared:{j}".encode()).digest() for j in range(SHARED)]
        shapes = {
            "unique": [block(7 % engines, j) for j in range(100)],  # one engine holds all 100
            "shared_prefix": shared + [block(3 % engines, j) for j in range(100 - SHARED)],
        }
        row: dict = {
            "engines": engines,
            "blocks_per_engine": blocks,
            "fill_events_per_s": round(events_per_s),
            "fill_events_per_s_previous_version": round(previous),
        }
        for shape, prompt in shapes.items():
            old, new = [], []
            for _ in range(lookups):
                ms_old, want = timed(lambda p=prompt: lookup_v1(client, SETTINGS, p))  # type: ignore[misc]
                ms_new, got = timed(lambda p=prompt: index.lookup(p))  # type: ignore[misc]
                assert got == want, (shape, engines)
                old.append(ms_old / 1e3)
                new.append(ms_new / 1e3)
            assert want is not None
            row[f"{shape}_engines_matched"] = len(want)
            row[f"{shape}_longest"] = max(m.longest for m in want.values())
            row[f"{shape}_old_scan_ms"] = {q: round(v * 1e3, 3) for q, v in percentiles(old).items()}
            row[f"{shape}_holder_walk_ms"] = {q: round(v * 1e3, 3) for q, v in percentiles(new).items()}
        row["redis_keys"] = client.dbsize()
        row["redis_used_memory_mb"] = round(client.info("memory")["used_memory"] / 2**20, 1)
        print(json.dumps(row), flush=True)
        index.close()
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--lookups", type=int, default=100)
    args = ap.parse_args()
    t0 = time.time()
    rows = [one_size(int(n), args.blocks, args.lookups) for n in args.sizes.split(",")]
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "machine": f"{platform.machine()}, 2 cores shared with other jobs (wall-clock figures are noisy)",
            "command": " ".join(["python benchmarks/index_scale.py", *sys.argv[1:]]),
            "note": "one run; latency is one synchronous client's wall clock per lookup (round trip, script, "
            "decoding), old and new alternating on the same index; redis-server shares the 2 cores",
        },
        "sizes": rows,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
