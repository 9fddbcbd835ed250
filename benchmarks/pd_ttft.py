"""TTFT of disaggregated (prefill -> NIXL -> decode) vs aggregated serving, real `kvferry serve` processes.

For each prompt length, the same random prompts go (a) to one aggregated engine, streaming, and (b)
to a prefill engine (`max_tokens=1`, do_remote_decode) and then, with the returned
kv_transfer_params, to a decode engine, streaming; TTFT is client-side from the first request sent to
the first token received. Medians; prints a table and writes JSON.

    python benchmarks/pd_ttft.py [--model PATH] [--lengths 512,1024,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"engine {' '.join(args)} did not become healthy")


def first_token_s(url: str, prompt: list[int], kv: dict | None = None) -> float:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if kv:
        body["kv_transfer_params"] = kv
    start_t = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start_t
    raise RuntimeError("no token")


def disaggregated_ttft(prefill: str, decode: str, prompt: list[int]) -> tuple[float, float]:
    start_t = time.perf_counter()
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = httpx.post(f"{prefill}/v1/completions", json=body, timeout=300).json()["kv_transfer_params"]
    prefill_s = time.perf_counter() - start_t
    return prefill_s + first_token_s(decode, prompt, params), prefill_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 from the model cache")
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--result-json", default=str(REPO / "benchmarks" / "results" / "pd_ttft.json"))
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from services.engine.worker.loader.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    common = ("--max-model-len", "4096", "--num-kv-blocks", "1024", "--no-prefix-caching")
    procs = []
    try:
        for role in ("both", "prefill", "decode"):
            procs.append(start(args.model, "--role", role, *common))
        (_, agg), (_, pre), (_, dec) = procs
        rng, rows = random.Random(0), []
        print("| prompt tokens | aggregated TTFT p50 | disaggregated TTFT p50 | of which prefill | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for n in (int(x) for x in args.lengths.split(",")):
            prompts = [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(args.repeats)]
            first_token_s(agg, prompts[0][:64])  # warm both paths
            disaggregated_ttft(pre, dec, prompts[0][:64])
            agg_s = [first_token_s(agg, p) for p in prompts]
            dis = [disaggregated_ttft(pre, dec, p) for p in prompts]
            row = {
                "prompt_tokens": n,
                "aggregated_ttft_p50_s": statistics.median(agg_s),
                "disaggregated_ttft_p50_s": statistics.median(d for d, _ in dis),
                "prefill_p50_s": statistics.median(p for _, p in dis),
            }
            row["ratio"] = row["disaggregated_ttft_p50_s"] / row["aggregated_ttft_p50_s"]
            rows.append(row)
            print(
                f"| {n} | {row['aggregated_ttft_p50_s'] * 1e3:.0f} ms | {row['disaggregated_ttft_p50_s'] * 1e3:.0f} ms"
                f" | {row['prefill_p50_s'] * 1e3:.0f} ms | {row['ratio']:.2f}x |",
                flush=True,
            )
        meta = {
            "model": args.model,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        }
        Path(args.result_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.result_json}")
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
