"""Quantized weights vs bf16 / fp32, same run: resident bytes, KV blocks that fit, decode tok/s, perplexity.

Also times each linear kernel by row count (the int4 / int8 packed kernels vs their dense path vs
oneDNN bf16) on SmolLM2's shapes, which is where Int4Linear / Int8Linear's crossovers come from.

    python benchmarks/quant.py [--models smollm2,medium] [--repeats 3] [--skip-kernels]
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

from services.engine import cpu_runtime  # noqa: E402  (torch-free)


def _with_serving_runtime() -> None:
    """Re-run this script once under the OpenMP runtime and allocator `kvferry serve` uses."""
    if os.environ.get(cpu_runtime.MARKER):
        return
    runtime = cpu_runtime.choose(os.environ)
    env = {**os.environ, **runtime.env, cpu_runtime.MARKER: runtime.description}
    if runtime.preload:
        env["LD_PRELOAD"] = ":".join((*runtime.preload, *filter(None, [os.environ.get("LD_PRELOAD")])))
    os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)


if __name__ == "__main__":
    _with_serving_runtime()

import torch  # noqa: E402

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.linear import PackedLinear  # noqa: E402
from services.engine.worker.loader.default_model import default_gguf_path, ensure_default_model  # noqa: E402
from services.engine.worker.model_runner import bytes_per_block  # noqa: E402
from services.engine.worker.quantization.group_quant_weight import GroupQuantWeight  # noqa: E402
from services.engine.worker.quantization.quantized_linear import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
KV_BUDGET_MB = 512  # the memory budget, beyond the bf16 weights, that weights + KV share
TEXT = Path(torch.__file__).parents[1] / f"torch-{torch.__version__}.dist-info" / "licenses" / "LICENSE"


def _time(fn, x: torch.Tensor, reps: int = 20) -> float:
    fn(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def kernel_table() -> list[dict]:
    rows_out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        dense = PackedLinear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False))
        q4 = Int4Linear(GroupQuantWeight.quantize(w, 4, 32), None, torch.bfloat16, min_dense_rows=10**9)
        q4d = Int4Linear(GroupQuantWeight.quantize(w, 4, 32), None, torch.bfloat16, min_dense_rows=0)
        q8 = Int8Linear(w, None, torch.bfloat16, min_dense_rows=10**9)
        q8d = Int8Linear(w, None, torch.bfloat16, min_dense_rows=0)
        with torch.no_grad():
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                r = {
                    "layer": name,
                    "rows": m,
                    "bf16_ms": _time(dense, x),
                    "int4_kernel_ms": _time(q4, x),
                    "int4_dense_ms": _time(q4d, x),
                    "int8_kernel_ms": _time(q8, x),
                    "int8_dense_ms": _time(q8d, x),
                }
                rows_out.append(r)
                print(
                    f"{name:8} rows {m:3}: bf16 {r['bf16_ms']:.3f}  int4 kernel {r['int4_kernel_ms']:.3f} dense "
                    f"{r['int4_dense_ms']:.3f}  int8 kernel {r['int8_kernel_ms']:.3f} dense {r['int8_dense_ms']:.3f} ms"
                )
    return rows_out


def configs(model: str) -> list[tuple[str, str, dict]]:
    if model == "smollm2":
        folder, gguf = str(ensure_default_model()), str(default_gguf_path())
        return [
            ("fp32", folder, dict(dtype="float32", quantization="none")),
            ("bf16", folder, dict(dtype="bfloat16", quantization="none")),
            ("gguf Q4_1", gguf, dict(dtype="bfloat16", quantization="auto")),
            ("int8", folder, dict(dtype="bfloat16", quantization="int8")),
            ("int4", folder, dict(dtype="bfloat16", quantization="int4")),
        ]
    from benchmarks.vs_vllm_setup import model_path

    folder = str(model_path("medium"))
    return [
        ("fp32", folder, dict(dtype="float32", quantization="none")),
        ("bf16", folder, dict(dtype="bfloat16", quantization="none")),
        ("int8", folder, dict(dtype="bfloat16", quantization="int8")),
        ("int4", folder, dict(dtype="bfloat16", quantization="int4")),
    ]


def decode_tok_s(llm: LLM, batch: int, vocab: int) -> float:
    prompts = [[3 + (i * 7919 + j * 31) % (vocab - 3) for j in range(32)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.engine.core.kv_manager.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, params)
    return batch * 64 / (time.perf_counter() - t)


def perplexity(llm: LLM, tokens: int = 1024) -> float:
    ids = llm.tokenizer.encode(TEXT.read_text())[:tokens]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = [lp.token_logprob for lp in out.prompt_logprobs if lp is not None]
    return float(torch.tensor(lps).neg().mean().exp())


def bench_model(model: str, repeats: int) -> list[dict]:
    rows = []
    engines = []
    for label, path, kw in configs(model):
        llm = LLM(model=path, num_kv_blocks=1024, max_num_seqs=64, **kw)
        core = llm.engine.core
        engines.append((label, llm))
        rows.append(
            {
                "model": model,
                "weights": label,
                "describe": core.quant.describe(),
                "weight_mb": llm.worker_stats().weight_bytes / 2**20,
                "block_mb": bytes_per_block(core.model_config, core.block_size, core.dtype) / 2**20,
                "perplexity": perplexity(llm) if model == "smollm2" else None,
                "b1": [],
                "b64": [],
            }
        )
    base = next(r for r in rows if r["weights"] == "bf16")
    budget = base["weight_mb"] + KV_BUDGET_MB
    vocab = engines[0][1].engine.core.model_config.vocab_size
    for rep in range(repeats):
        for (label, llm), r in zip(engines, rows, strict=True):
            r["b1"].append(decode_tok_s(llm, 1, vocab))
            r["b64"].append(decode_tok_s(llm, 64, vocab))
            print(
                f"[{model} r{rep + 1}] {label}: batch 1 {r['b1'][-1]:.1f} tok/s, batch 64 {r['b64'][-1]:.0f} tok/s",
                flush=True,
            )
    for r in rows:
        r["kv_blocks_in_budget"] = int((budget - r["weight_mb"]) / r["block_mb"])
        r["b1_tok_s"], r["b64_tok_s"] = statistics.median(r["b1"]), statistics.median(r["b64"])
    for r in rows:
        r["bytes_vs_bf16"] = r["weight_mb"] / base["weight_mb"]
        r["b1_vs_bf16"], r["b64_vs_bf16"] = (
            r["b1_tok_s"] / base["b1_tok_s"],
            r["b64_tok_s"] / base["b64_tok_s"],
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,medium")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    result: dict = {
        "runtime": cpu_runtime.describe(),
        "kernels": [] if args.skip_kernels else kernel_table(),
        "models": [],
    }
    for model in args.models.split(","):
        result["models"] += bench_model(model, args.repeats)
    print(
        "\n| model | weights | MB | × bf16 | KV blocks in bf16+512 MB | batch 1 tok/s (× bf16) | batch 64 tok/s (× bf16) | perplexity |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in result["models"]:
        ppl = f"{r['perplexity']:.3f}" if r["perplexity"] else "–"
        print(
            f"| {r['model']} | {r['weights']} | {r['weight_mb']:.0f} | {r['bytes_vs_bf16']:.2f} | {r['kv_blocks_in_budget']} | "
            f"{r['b1_tok_s']:.1f} ({r['b1_vs_bf16']:.2f}×) | {r['b64_tok_s']:.0f} ({r['b64_vs_bf16']:.2f}×) | {ppl} |"
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
