"""Sliding-window attention: one random Mistral-shaped checkpoint served with its window and without
(full attention), same weights and prompts, same run: decode tok/s and the most KV blocks held.

A 4-layer h512 model (8 heads, 2 KV heads, head dim 64), fp32 on CPU; 8 prompts x 1536 tokens -> 256
new tokens, greedy; window 256. With the window, each layer reads at most 256 positions per query and
the blocks before the window go back to the pool as the requests advance. Interleaved repeats,
medians. Prints a table, writes benchmarks/results/sliding_window.json.

    python benchmarks/sliding_window.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

WINDOW, PROMPT, NEW, BATCH = 256, 1536, 256, 8


def checkpoints(root: Path) -> dict[str, Path]:
    """The same weights twice: config.json with and without the window (context 4096 in both)."""
    full = root / "full"
    if not (full / "config.json").exists():
        build_checkpoint(full, "mistral", hidden=512, layers=4, heads=8, vocab_size=2048)
    windowed = root / "windowed"
    shutil.copytree(full, windowed, dirs_exist_ok=True)
    for path, window in ((full, None), (windowed, WINDOW)):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(sliding_window=window, max_position_embeddings=4096)
        (path / "config.json").write_text(json.dumps(cfg))
    return {"full attention": full, f"window {WINDOW}": windowed}


def run_once(llm: LLM, prompts: list[list[int]]) -> tuple[float, int]:
    """(seconds for the batch, most blocks held at once)."""
    kv = llm.engine.core.kv_manager
    most = 0
    allocate = kv.allocate_slots

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - wraps the real method
        nonlocal most
        out = allocate(*args, **kwargs)
        most = max(most, kv.pool.num_blocks - kv.pool.num_free_blocks)
        return out

    kv.allocate_slots = counting  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        return time.perf_counter() - start, most
    finally:
        del kv.allocate_slots
        llm.engine.core.kv_manager.reset_prefix_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    paths = checkpoints(kvferry_home() / "bench" / "sliding_window")
    prompts = [[3 + (i * 31 + j * 7) % 2000 for j in range(PROMPT)] for i in range(BATCH)]
    llms = {
        name: LLM(model=str(p), dtype="float32", num_kv_blocks=1024, max_num_seqs=BATCH, max_model_len=4096)
        for name, p in paths.items()
    }
    for llm in llms.values():
        run_once(llm, prompts[:1])  # warm-up
    times: dict[str, list[float]] = {n: [] for n in llms}
    blocks: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            secs, most = run_once(llm, prompts)
            times[name].append(secs)
            blocks[name] = most
    rows = []
    for name in llms:
        secs = sorted(times[name])[len(times[name]) // 2]
        rows.append(
            {"engine": name, "seconds": secs, "tok_s": BATCH * NEW / secs, "max_blocks": blocks[name]}
        )
    base = rows[0]["tok_s"]
    print(
        f"{BATCH} x {PROMPT} -> {NEW} tokens, 4-layer h512 Mistral, fp32, block 16, median of {args.repeats}"
    )
    print(f"{'attention':<16}{'output tok/s':>14}{'vs full':>9}{'most KV blocks':>16}")
    for r in rows:
        print(f"{r['engine']:<16}{r['tok_s']:>14.1f}{r['tok_s'] / base:>8.2f}x{r['max_blocks']:>16}")
    out = ROOT / "benchmarks" / "results" / "sliding_window.json"
    out.write_text(json.dumps({"batch": BATCH, "prompt": PROMPT, "new": NEW, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
