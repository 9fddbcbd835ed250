"""MoE: kvferry's MoE layer vs a naive per-(token, expert) loop vs HF's MixtralSparseMoeBlock, same run,
and end to end a tiny Mixtral on kvferry vs HF generate.

Layer: Mixtral-shaped at a quarter width (H 1024, I 3584, 8 experts, top-2), bf16 on CPU, the same
weights and tokens in all three (and kvferry's with int8 experts, as --quantization int8 holds them);
1 / 16 / 256 tokens; median of interleaved repeats. End to end: a random 4-layer h512 Mixtral (8
experts, top-2), 16 prompts x 64 tokens -> 64 tokens, greedy, float and int8. With a
CUDA device the layer rows also time the Triton fused kernel. Prints tables, writes
benchmarks/results/moe.json.

    python benchmarks/moe.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.attention import select_backend  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from services.engine.worker.model_config import ModelConfig  # noqa: E402
from services.engine.worker.models.moe import MoEBlock  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

H, INTER, E, K = 1024, 3584, 8, 2


def layers(dtype: torch.dtype, device: torch.device) -> tuple[MoEBlock, torch.nn.Module]:
    """kvferry's block and HF's, holding the same random weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K)
    hf = MixtralSparseMoeBlock(hf_cfg).to(dtype).to(device).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.02)
    cfg = ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=8, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, head_dim=H // 8, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=INTER,
    )  # fmt: skip
    ours = MoEBlock(cfg, None).to(dtype).to(device).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
    return ours, hf


def naive(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The definition, one (token, chosen expert) pair at a time."""
    probs = torch.softmax(F.linear(x.float(), block.gate.weight.float()), dim=-1)
    weights, ids = torch.topk(probs, K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            gate, up = (block.w13[e] @ x[t]).chunk(2)
            out[t] += (weights[t, k] * (block.w2[e] @ (F.silu(gate) * up))).to(x.dtype)
    return out


def layer_rows(dtype: torch.dtype) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ours, hf = layers(dtype, device)
    backends = {
        "kvferry (grouped, torch/C++)": select_backend(
            torch.device("cpu"), "cpu" if device.type == "cpu" else "torch"
        )
    }
    if device.type == "cuda":
        backends["kvferry (Triton fused)"] = select_backend(device, "triton")
    int8 = copy.deepcopy(ours)
    int8.quantize_int8()  # what --quantization int8 does to the experts
    rows = []
    with torch.no_grad():
        for tokens in (1, 16, 256):
            x = torch.randn(tokens, H, dtype=dtype, device=device)
            fns = {name: (lambda b=b, x=x: ours(x, b)) for name, b in backends.items()}
            for name, b in backends.items():
                fns[name.replace("kvferry", "kvferry int8 experts")] = lambda b=b, x=x: int8(x, b)
            fns["HF MixtralSparseMoeBlock"] = lambda x=x: hf(x[None])
            if tokens <= 16:
                fns["naive per-(token, expert) loop"] = lambda x=x: naive(ours, x)
            times = median_ms(list(fns.values()), min_reps=5, budget_s=2.0)
            for name, ms in zip(fns, times, strict=True):
                rows.append({"tokens": tokens, "impl": name, "ms": ms})
                print(f"layer {tokens:>3} tokens  {name}: {ms:.3f} ms", flush=True)
    return rows


def e2e(dtype: str) -> list[dict]:
    from transformers import AutoModelForCausalLM

    path = kvferry_home() / "bench-models" / "mixtral-h512"
    if not (path / "config.json").is_file():
        build_checkpoint(path, "mixtral", hidden=512, layers=4, heads=8, vocab_size=32000)
    prompts = [[3 + (i * 7919 + j * 31) % 31000 for j in range(64)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tok_s = {}
    for quant in ("none", "int8"):
        llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=512, quantization=quant)
        llm.generate(prompts[:2], params)
        start = time.perf_counter()
        llm.generate(prompts, params)
        tok_s[quant] = 16 * 64 / (time.perf_counter() - start)
        del llm
    ours = tok_s["none"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        hf.generate(ids[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    theirs = 16 * 64 / (time.perf_counter() - start)
    print(f"e2e: kvferry {ours:.0f} tok/s (int8 {tok_s['int8']:.0f}), HF generate {theirs:.0f} tok/s")
    return [
        {"engine": "kvferry", "tok_s": ours},
        {"engine": "kvferry --quantization int8 (experts too)", "tok_s": tok_s["int8"]},
        {"engine": "HF generate", "tok_s": theirs},
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = layer_rows(getattr(torch, args.dtype))
    ends = e2e(args.dtype)
    lines = ["| tokens | implementation | ms |", "|---:|---|---:|"]
    lines += [f"| {r['tokens']} | {r['impl']} | {r['ms']:.3f} |" for r in rows]
    lines += ["", "| tiny Mixtral, 16 x 64 -> 64 | output tok/s |", "|---|---:|"]
    lines += [f"| {r['engine']} | {r['tok_s']:.0f} |" for r in ends]
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({"dtype": args.dtype, "layer": rows, "e2e": ends}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
