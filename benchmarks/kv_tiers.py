"""KV tiers: a multi-turn agentic workload whose working set is several times one engine's primary KV pool,
served with the primary pool only, + the host-memory tier, and + host + disk, side by side in one run.

Sessions share a system prompt; each turn appends the previous answer and a new user message, so every
turn's prompt extends the last one. Sessions take turns (round robin), so the primary pool has evicted a
session's prefix by its next turn: the primary-only engine recomputes it, the tiered ones load it back.
TTFT is the wall time of a one-token request of the turn's prompt (prefill dominates); each turn's answer
is then generated (its tokens join the history). Same model, weights, prompts and order for every config;
configs take turns per round. Prints a table, writes benchmarks/results/kv_tiers.json.

    python benchmarks/kv_tiers.py [--sessions 6 --turns 4 --system 384 --user 64 --answer 16]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402


def _steal() -> float | None:
    """The CPU time stolen from this VM so far (s), from /proc/stat (None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def sessions(n: int, turns: int, system: int, user: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """Per session, per turn: the new user tokens (the system prompt is turn 0's first part)."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(system)]
    out = []
    for _ in range(n):
        parts = [shared + [rng.randrange(10, vocab) for _ in range(user)]]
        parts += [[rng.randrange(10, vocab) for _ in range(user)] for _ in range(turns - 1)]
        out.append(parts)
    return out


def run(llm: LLM, work: list[list[list[int]]], answer: int) -> list[float]:
    """TTFT (s) of every turn, sessions round robin; histories grow with each answer."""
    history: list[list[int]] = [[] for _ in work]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rest = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    ttft = []
    for turn in range(len(work[0])):
        for s, parts in enumerate(work):
            prompt = history[s] + parts[turn]
            t0 = time.perf_counter()
            llm.generate([prompt], first)
            ttft.append(time.perf_counter() - t0)
            out = llm.generate([prompt], rest)[0].outputs[0].token_ids
            history[s] = prompt + list(out)
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=384)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--primary-blocks", type=int, default=64, help="the primary pool (16-token blocks)")
    args = ap.parse_args()
    model = kvferry_home() / "models" / "SmolLM2-135M-Instruct"
    work = sessions(args.sessions, args.turns, args.system, args.user, 49152)
    last = args.system + args.turns * (args.user + args.answer)
    working_set = args.sessions * last // 16
    disk = Path(tempfile.mkdtemp(prefix="kvferry-kv-tiers-"))
    common = dict(model=str(model), dtype="float32", num_kv_blocks=args.primary_blocks, max_model_len=2048)
    probe = LLM(**common)
    stats = probe.worker_stats()
    per_block = stats.kv_cache_bytes // stats.kv_cache_shape[0]
    probe.shutdown()
    configs = {
        "(a) primary only": {},
        "(c) + host tier": {"kv_offload_cpu_bytes": 2 * working_set * per_block},
        "(d) + host + disk": {
            "kv_offload_cpu_bytes": working_set * per_block // 4,
            "kv_offload_disk_path": str(disk),
            "kv_offload_disk_bytes": 2 * working_set * per_block,
        },
    }
    steal0, t0 = _steal(), time.time()
    rows = []
    for name, extra in configs.items():
        llm = LLM(**common, **extra)
        llm.generate([[11, 12, 13]], SamplingParams(max_tokens=1))  # warm-up
        start = time.perf_counter()
        ttft = run(llm, work, args.answer)
        wall = time.perf_counter() - start
        blocks, failures = llm.engine.core.transfer_stats()
        llm.shutdown()
        q = statistics.quantiles(ttft, n=10)
        rows.append(
            {
                "config": name,
                "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "ttft_p90_ms": q[8] * 1e3,
                "wall_s": wall,
                "blocks_from_cpu": blocks.get(("received", "cpu"), 0),
                "blocks_from_disk": blocks.get(("received", "disk"), 0),
                "drops": sum(failures.values()),
            }
        )
    shutil.rmtree(disk, ignore_errors=True)
    steal1 = _steal()
    base = rows[0]["ttft_p50_ms"]
    print(
        f"SmolLM2-135M fp32, {args.sessions} sessions x {args.turns} turns, system {args.system}, "
        f"user {args.user}, answer {args.answer}; primary {args.primary_blocks} blocks, working set "
        f"~{working_set} blocks ({working_set / args.primary_blocks:.1f}x)"
    )
    print(
        f"{'config':<20}{'TTFT p50 ms':>12}{'p90 ms':>9}{'vs (a)':>8}{'wall s':>8}{'from cpu':>10}{'from disk':>10}"
    )
    for r in rows:
        print(
            f"{r['config']:<20}{r['ttft_p50_ms']:>12.1f}{r['ttft_p90_ms']:>9.1f}{base / r['ttft_p50_ms']:>7.2f}x"
            f"{r['wall_s']:>8.1f}{r['blocks_from_cpu']:>10}{r['blocks_from_disk']:>10}"
        )
    out = ROOT / "benchmarks" / "results" / "kv_tiers.json"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "steal_s": None if steal0 is None or steal1 is None else round(steal1 - steal0, 1),
        "workload": vars(args) | {"working_set_blocks": working_set},
    }
    out.write_text(json.dumps(meta | {"rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
