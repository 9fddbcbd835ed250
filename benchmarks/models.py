"""Model families side by side: KV bytes per token (what each caches, pages and ferries) against a Llama
(MHA) of the same hidden size and heads, the real DeepSeek-V3 shape from its config numbers, and decode
tok/s at batch 1 and 16 on CPU.

Tiny-ish random checkpoints (hidden 256, 8 heads; vocab 2048) of Llama (GQA, 2 KV heads), Gemma 3, gpt-oss
and DeepSeek-V3 (MLA: kv_lora_rank 32 + rope 8, 3 layers), the engine's default dtype; each prompt 16
tokens -> 32 new tokens, greedy; tok/s = output tokens / wall time of the generate call (median of
--repeats, interleaved over the families). KV bytes per token are read from the engine (``LLM.worker_stats()``) and checked against the
formula; DeepSeek-V3's are computed by the engine's own sizing from the released config's numbers (61
layers, kv_lora_rank 512, rope 64, 128 heads of 128 + 64 qk / 128 v). Prints tables, writes
benchmarks/results/models.json.

    python benchmarks/models.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path.pop(0)  # benchmarks/kernels.py would shadow the `kernels` package transformers imports
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from services.engine.worker.model_config import ModelConfig  # noqa: E402
from services.engine.worker.model_runner import bytes_per_block  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

FAMILIES = {"llama": "llama", "gemma3": "gemma3", "gpt-oss": "gpt_oss", "deepseek-v3 (MLA)": "deepseek_v3"}
HIDDEN, HEADS, PROMPT, NEW = 256, 8, 16, 32
# DeepSeek-V3 (671B) config.json, the numbers that size its KV
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
}  # fmt: skip


def mha_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """A Llama (MHA) of the same hidden size and heads: K and V of hidden_size each, per layer."""
    return cfg.num_hidden_layers * 2 * cfg.hidden_size * dtype_bytes


def expanded_bytes(cfg: ModelConfig, dtype_bytes: int) -> int | None:
    """MLA's keys and values expanded per head (heads x (qk_nope + rope + v)), as plain MHA would cache."""
    if cfg.mla is None:
        return None
    return (
        cfg.num_hidden_layers
        * cfg.num_attention_heads
        * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
        * dtype_bytes
    )


def expected_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """What the family should cache per token: the latent for MLA, 2 x KV heads x head_dim otherwise."""
    per_layer = cfg.mla.latent_size if cfg.mla else 2 * cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_hidden_layers * per_layer * dtype_bytes


def family_row(name: str, llm: LLM, cfg: ModelConfig) -> dict:
    """The family's KV bytes per token as the engine reports it (checked against the formula)."""
    stats = llm.worker_stats()
    dtype_bytes = stats.kv_cache_bytes // torch.Size(stats.kv_cache_shape).numel()
    per_token = stats.kv_bytes_per_token
    if per_token != expected_bytes(cfg, dtype_bytes):
        raise SystemExit(
            f"{name}: the engine caches {per_token} B per token, not {expected_bytes(cfg, dtype_bytes)}"
        )
    row = {"family": name, "layers": cfg.num_hidden_layers, "dtype_bytes": dtype_bytes, "kv_bytes_per_token": per_token,
           "mha_same_hidden_bytes": mha_bytes(cfg, dtype_bytes), "mla_expanded_bytes": expanded_bytes(cfg, dtype_bytes)}  # fmt: skip
    row["vs_mha"] = round(row["mha_same_hidden_bytes"] / per_token, 2)
    if row["mla_expanded_bytes"]:
        row["vs_expanded"] = round(row["mla_expanded_bytes"] / per_token, 2)
    return row


def decode_tok_s(llms: dict[str, LLM], repeats: int) -> dict[tuple[str, int], float]:
    """Output tok/s per (family, batch): repeats interleaved over the families, medians."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {}
    for llm in llms.values():
        llm.generate([[5] * PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    for _ in range(repeats):
        for name, llm in llms.items():
            for batch in (1, 16):
                prompts = [[3 + (i * 131 + j * 17) % 2000 for j in range(PROMPT)] for i in range(batch)]
                start = time.perf_counter()
                llm.generate(prompts, params)
                times.setdefault((name, batch), []).append(time.perf_counter() - start)
    return {(n, b): round(b * NEW / statistics.median(t), 1) for (n, b), t in times.items()}


def deepseek_v3_row() -> dict:
    """The released DeepSeek-V3 shape, sized by the engine's own bytes_per_block (bf16)."""
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    per_token = bytes_per_block(cfg, 1, torch.bfloat16)
    assert per_token == expected_bytes(cfg, 2)
    expanded = expanded_bytes(cfg, 2)
    assert expanded is not None
    return {"family": "DeepSeek-V3 671B shape (bf16, computed)", "layers": cfg.num_hidden_layers, "dtype_bytes": 2,
            "kv_bytes_per_token": per_token, "mha_same_hidden_bytes": mha_bytes(cfg, 2),
            "mla_expanded_bytes": expanded, "vs_mha": round(mha_bytes(cfg, 2) / per_token, 2),
            "vs_expanded": round(expanded / per_token, 2)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "models.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    root = kvferry_home() / "bench-models" / "families"
    llms, rows = {}, []
    for name, kind in FAMILIES.items():
        path = root / kind
        if not (path / "config.json").is_file():
            build_checkpoint(path, kind, hidden=HIDDEN, heads=HEADS, vocab_size=2048)
        llms[name] = LLM(model=str(path), num_kv_blocks=256, max_num_seqs=16)
        rows.append(family_row(name, llms[name], ModelConfig.from_folder(path)))
    speeds = decode_tok_s(llms, args.repeats)
    for row in rows:
        row["decode_tok_s_b1"], row["decode_tok_s_b16"] = speeds[row["family"], 1], speeds[row["family"], 16]
    real = deepseek_v3_row()
    lines = ["| family | layers | KV B/token | MHA same hidden | ratio | MLA expanded | ratio | tok/s b1 | tok/s b16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in [*rows, real]:
        lines.append(
            f"| {r['family']} | {r['layers']} | {r['kv_bytes_per_token']} | {r['mha_same_hidden_bytes']} | "
            f"{r['vs_mha']}x | {r.get('mla_expanded_bytes') or '–'} | {r.get('vs_expanded', '–')} | "
            f"{r.get('decode_tok_s_b1', '–')} | {r.get('decode_tok_s_b16', '–')} |"
        )
    print("\n".join(lines))
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}  # fmt: skip
    note = "decode tok/s: 2 CPU cores shared with other work, noisy; compare within this run only"
    out = {"meta": meta, "note": note, "families": rows, "deepseek_v3": real}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
