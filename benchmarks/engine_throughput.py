"""Offline throughput: kvferry's engine vs HF transformers `generate` (batched, dense KV), side by side.

Workloads (issue 2): 64 prompts x 128 random tokens -> 128 tokens, and 64 prompts sharing a 512-token
prefix + 32 unique tokens -> 128 tokens; ignore_eos, greedy. Models: random-weight Llamas built
offline (a 4-layer h256 and a 12-layer h768 one, vocab 32000). Prints a table, writes JSON.

    python benchmarks/engine_throughput.py [--models small,medium] [--num-prompts 64]
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default; applies to HF in this process too

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

MODELS = {"small": dict(hidden=256, layers=4, heads=4), "medium": dict(hidden=768, layers=12, heads=12)}
VOCAB = 32000


def model_dir(name: str) -> Path:
    path = kvferry_home() / "bench-models" / f"llama-{name}"
    if not (path / "config.json").is_file():
        build_checkpoint(path, "llama", vocab_size=VOCAB, **MODELS[name])
    return path


def workloads(n: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    rand = [[rng.randrange(3, VOCAB) for _ in range(128)] for _ in range(n)]
    prefix = [rng.randrange(3, VOCAB) for _ in range(512)]
    shared = [prefix + [rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(n)]
    return {"random 128->128": rand, "shared-prefix 512+32->128": shared}


def run_kvferry(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.engine.core.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return elapsed


def run_hf(model, prompts: list[list[int]], out_len: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + out_len
    return elapsed


def bench_model(name: str, n: int, out_len: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    path = model_dir(name)
    llm = LLM(model=str(path), max_num_seqs=n, max_model_len=1024, kv_cache_memory_gb=2.0)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    run_kvferry(llm, [[5] * 16] * 2, 4)  # warm-up both
    run_hf(hf, [[5] * 16] * 2, 4)
    rows = []
    for wl, prompts in workloads(n).items():
        prompt_tokens = sum(len(p) for p in prompts)
        gen = n * out_len
        t_kv = run_kvferry(llm, prompts, out_len)
        t_hf = run_hf(hf, prompts, out_len)
        rows.append(
            {
                "model": f"llama-{name}",
                "workload": wl,
                "num_prompts": n,
                "kvferry_s": t_kv,
                "hf_s": t_hf,
                "kvferry_out_tok_s": gen / t_kv,
                "hf_out_tok_s": gen / t_hf,
                "kvferry_total_tok_s": (gen + prompt_tokens) / t_kv,
                "hf_total_tok_s": (gen + prompt_tokens) / t_hf,
                "ratio": t_hf / t_kv,
            }
        )
        print_row(rows[-1])
    return rows


def print_row(r: dict) -> None:
    print(
        f"| {r['model']:<12} | {r['workload']:<26} | {r['kvferry_out_tok_s']:>9.0f} | {r['hf_out_tok_s']:>9.0f} | "
        f"{r['kvferry_total_tok_s']:>9.0f} | {r['hf_total_tok_s']:>9.0f} | {r['ratio']:>5.2f}x |",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,medium")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--result-json", default=str(Path(__file__).parent / "results" / "engine_throughput.json")
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model        | workload                   | kvferry out tok/s | HF out tok/s | kvferry total tok/s | "
        "HF total tok/s | speed-up |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = [
        r for m in args.models.split(",") for r in bench_model(m.strip(), args.num_prompts, args.output_len)
    ]
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "device": "cpu",
        "command": " ".join(sys.argv),
    }
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
