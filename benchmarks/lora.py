"""Multi-LoRA throughput: 64 requests spread over {1, 4, 16} adapters vs the base model alone, same run.

Adapters: random rank-16 PEFT adapters on all of SmolLM2's q/k/v/o/gate/up/down projections (written
once into $KVFERRY_HOME/bench-models/loras). Greedy, ignore_eos, 64 prompts x 64 tokens -> 64 tokens,
median of 3 interleaved repeats; one engine with --max-loras 16 serves every row. Reports output tokens
per wall second and per CPU second of this process (with --threads 1 the latter is the work done,
whatever else the machine runs). Prints a table, writes benchmarks/results/lora.json.

    python benchmarks/lora.py [--repeats 3] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import ensure_default_model, kvferry_home  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(base: Path, count: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = kvferry_home() / "bench-models" / "loras"
    out = {}
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
            get_peft_model(model, cfg).save_pretrained(str(path))
        out[f"a{i}"] = str(path)
    return out


def run(llm: LLM, names: list[str | None], max_tokens: int) -> tuple[float, float]:
    """Output tokens per wall second, and per CPU second of this process (robust to a busy machine)."""
    prompts = [[3 + (i * 7919 + j * 31) % 49000 for j in range(64)] for i in range(len(names))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.core.kv_manager.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, lora_name=names)
    tokens = len(names) * max_tokens
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (1 on a busy machine)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora.json"))
    ap.add_argument("--quick", action="store_true", help="1 repeat of 32 output tokens (a busy machine)")
    args = ap.parse_args()
    max_tokens = 32 if args.quick else 64
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(args.threads)
    base = ensure_default_model()
    loras = adapters(base, 16, args.rank)
    llm = LLM(
        model=str(base),
        dtype=args.dtype,
        num_kv_blocks=1024,
        enable_lora=True,
        max_loras=16,
        max_lora_rank=args.rank,
        lora_modules=loras,
    )
    rows: dict[str, list[str | None]] = {"base model": [None] * 64}
    for k in (1, 4, 16):
        rows[f"{k} adapter{'s' if k > 1 else ''}"] = [f"a{i % k}" for i in range(64)]
    run(llm, rows["16 adapters"][:16], 4)  # warm-up: every adapter in its slot
    wall: dict[str, list[float]] = {label: [] for label in rows}
    cpu: dict[str, list[float]] = {label: [] for label in rows}
    for rep in range(repeats):
        for label, names in rows.items():
            w, c = run(llm, names, max_tokens)
            wall[label].append(w)
            cpu[label].append(c)
            print(f"[r{rep + 1}] {label}: {w:.0f} tok/s, {c:.0f} tok per CPU second", flush=True)
    base_wall, base_cpu = statistics.median(wall["base model"]), statistics.median(cpu["base model"])
    result = {
        "model": base.name,
        "dtype": args.dtype,
        "rank": args.rank,
        "requests": 64,
        "output_tokens": max_tokens,
        "threads": args.threads,
        "lora_ops": llm.engine.core.lora.ops.name if llm.engine.core.lora else None,
        "load_average": os.getloadavg(),
        "rows": [],
    }
    print(
        "\n| 64 requests over | output tok/s | × base | tok per CPU s | × base |\n|---|---:|---:|---:|---:|"
    )
    for label in rows:
        w, c = statistics.median(wall[label]), statistics.median(cpu[label])
        result["rows"].append(
            {
                "workload": label,
                "tok_s": w,
                "vs_base": w / base_wall,
                "tok_per_cpu_s": c,
                "cpu_vs_base": c / base_cpu,
                "repeats": wall[label],
                "repeats_cpu": cpu[label],
            }
        )
        print(f"| {label} | {w:.0f} | {w / base_wall:.2f} | {c:.0f} | {c / base_cpu:.2f} |")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
