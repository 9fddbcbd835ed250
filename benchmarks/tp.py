"""Tensor and pipeline parallelism on CPU: the same 12-layer h768 random Llama with one rank, with
tensor_parallel_size 2 and with pipeline_parallel_size 2 (gloo, two processes), same run: output tok/s,
decode step time, and rank 0's time in collectives (or stage hand-offs) per step.

Workloads: batch 1, 128 -> 128 tokens, and batch 16, 128 -> 64, greedy, fp32. On a 2-core machine TP=2
gives each rank one core of the two TP=1 already uses, and adds two all-reduces per layer plus a logits
all-gather per step; PP=2 runs its two stages one after the other (no micro-batching), each on one
core, plus a hand-off and a logits broadcast per step: no gain is expected here; the table says how
much each costs. Interleaved repeats, medians. Prints a table, writes benchmarks/results/tp.json.

    python benchmarks/tp.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

VOCAB = 32000
WORKLOADS = {"batch 1, 128 -> 128": (1, 128), "batch 16, 128 -> 64": (16, 64)}
LAYOUTS = {"1": {}, "TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2}}


def model_dir() -> Path:
    path = kvferry_home() / "bench-models" / "llama-medium"
    if not (path / "config.json").is_file():
        build_checkpoint(path, "llama", vocab_size=VOCAB, hidden=768, layers=12, heads=12)
    return path


class CollectiveClock:
    """Seconds rank 0 spends in its groups' collectives and sends (wraps their methods in place)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        core = llm.engine.core
        for group, names in (
            (core.tp, ("all_reduce", "all_gather_last")),
            (core.pp, ("send_hidden", "share_logits")),
        ):
            for name in names if group is not None else ():
                method = getattr(group, name)
                object.__setattr__(group, name, self._timed(method))  # frozen dataclass: set on the instance

    def _timed(self, method):  # noqa: ANN001, ANN202 - wraps a bound method
        def timed(*args):  # noqa: ANN002, ANN202
            start = time.perf_counter()
            out = method(*args)
            self.seconds += time.perf_counter() - start
            return out

        return timed


def run(llm: LLM, clock: CollectiveClock, batch: int, new: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(128)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.engine.core.kv_manager.reset_prefix_cache()
    clock.seconds = 0.0
    start = time.perf_counter()
    llm.generate(prompts, params)
    secs = time.perf_counter() - start
    steps = new  # one prefill step (the prompts fit one budget) then new - 1 decode steps
    return {"tok_s": batch * new / secs, "ms_per_step": 1000 * secs / steps,
            "collective_ms_per_step": 1000 * clock.seconds / steps}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = model_dir()
    llms = {
        name: LLM(model=str(path), dtype="float32", num_kv_blocks=1024, **kw) for name, kw in LAYOUTS.items()
    }
    clocks = {name: CollectiveClock(llm) for name, llm in llms.items()}
    for name, llm in llms.items():
        run(llm, clocks[name], 1, 8, 0)  # warm-up
    results: dict[str, dict[str, list[dict[str, float]]]] = {w: {n: [] for n in LAYOUTS} for w in WORKLOADS}
    for r in range(args.repeats):
        for name, (batch, new) in WORKLOADS.items():
            for layout, llm in llms.items():
                results[name][layout].append(run(llm, clocks[layout], batch, new, r))
    for llm in llms.values():
        llm.shutdown()
    rows = []
    for name, by_layout in results.items():
        for layout, runs in by_layout.items():
            med = {k: sorted(x[k] for x in runs)[len(runs) // 2] for k in runs[0]}
            rows.append({"workload": name, "ranks": layout, **med})
    print(f"12-layer h768 Llama, fp32, CPU (gloo), median of {args.repeats}")
    print(f"{'workload':<22}{'ranks':>6}{'tok/s':>10}{'ms/step':>10}{'collectives ms/step':>21}{'vs 1':>9}")
    for r in rows:
        base = next(x for x in rows if x["workload"] == r["workload"] and x["ranks"] == "1")["tok_s"]
        print(f"{r['workload']:<22}{r['ranks']:>6}{r['tok_s']:>10.1f}{r['ms_per_step']:>10.1f}"
              f"{r['collective_ms_per_step']:>21.2f}{r['tok_s'] / base:>8.2f}x")  # fmt: skip
    out = ROOT / "benchmarks" / "results" / "tp.json"
    out.write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
