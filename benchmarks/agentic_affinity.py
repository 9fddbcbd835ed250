"""Agent sessions side by side: today's prefix-aware scorer vs sticky-until-saturated vs round robin.

Each policy gets its own `kvferry up` stack (3 aggregated engines of the default SmolLM2, a fresh Redis)
and the same `kvferry bench serve --dataset agentic` workload; the policies take turns per repeat, so a
noisy neighbour slows them alike. Sticky-until-saturated is run as a user runs it: `kvferry router
calibrate` first measures one engine with prompts of the workload's size and writes the pool's token-load
limit to its Redis (without it a session stays on its engine until that engine's KV cache is full). Prints a table (session completion p50/p90, turn TTFT p50, prefix hit
rate; medians over repeats; ratios to the scorer and to round robin) and writes
benchmarks/results/agentic_affinity.json.
Usage: python benchmarks/agentic_affinity.py [--repeats 1] [--sessions 12] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {
    "prefix-aware": ["--strategy", "prefix-aware"],
    "sticky": ["--strategy", "prefix-aware", "--router-args=--session-affinity"],
    "round-robin": ["--strategy", "round-robin"],
}
METRICS = ("session_p50_s", "session_p90_s", "turn_ttft_p50_s", "prefix_hit_rate")


def _up(log_dir: Path, policy: list[str]) -> tuple[subprocess.Popen[str], str, str]:
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--engines",
        "3",
        "--port",
        "0",
        "--log-dir",
        str(log_dir),
    ]
    proc = subprocess.Popen(
        [*cmd, *policy], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline, url, redis = time.monotonic() + 600, None, ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"OpenAI API at (http://\S+)/v1", line):
            url = m.group(1)
        if m := re.search(r"redis\s+ready\s+(redis://\S+)", line):
            redis = m.group(1)
        if "Press Ctrl-C" in line or time.monotonic() > deadline:
            break
    if url is None:
        proc.kill()
        raise RuntimeError(f"kvferry up did not start: see {log_dir}")
    return proc, url, redis


def _engine_url(up: subprocess.Popen[str]) -> str:
    """engine-0's URL (from its command line: `kvferry up` starts it on a free port)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(up.pid)], capture_output=True, text=True).stdout
    for pid in out.split():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "--engine-id" in argv and argv[argv.index("--engine-id") + 1] == "engine-0":
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    raise RuntimeError("engine-0 not found under kvferry up")


def _calibrate(up: subprocess.Popen[str], redis: str, args: argparse.Namespace) -> float:
    """`kvferry router calibrate` on engine-0 with the workload's prompt size; the limit it wrote."""
    cmd = [sys.executable, "-m", "services.cli", "router", "calibrate", "--engine", _engine_url(up),
           "--redis-url", redis, "--levels", f"1,2,{args.concurrency},{2 * args.concurrency}",
           "--prompt-words", "200", "--max-tokens", "16"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["limit_tokens"])


def _bench(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--url", url, "--dataset", "agentic",
           "--endpoint", "chat", "--num-prompts", str(args.sessions), "--turns", str(args.turns),
           "--prefix-len", "256", "--input-len", "32", "--output-len", "16", "--subagents", "1",
           "--tool-pause", "0.2", "--max-concurrency", str(args.concurrency), "--no-progress",
           "--result-json", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=6)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    limits: list[float] = []  # the calibrated sticky limits (tokens), one per repeat
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, policy in POLICIES.items():
                proc, url, redis = _up(Path(tmp) / f"{name}-{rep}", policy)
                try:
                    if name == "sticky":
                        limits.append(_calibrate(proc, redis, args))
                    runs[name].append(_bench(url, args, Path(tmp) / f"{name}-{rep}.json"))
                finally:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(60)
                print(f"repeat {rep} {name}: {runs[name][-1]}", flush=True)
    med = {
        p: {m: statistics.median(r[m] for r in rs if r[m] is not None) for m in METRICS}
        for p, rs in runs.items()
    }
    print(f"\n{'policy':14} {'session p50 s':>14} {'session p90 s':>14} {'TTFT p50 s':>11} {'hit rate':>9}")
    for p, m in med.items():
        print(f"{p:14} {m['session_p50_s']:14.2f} {m['session_p90_s']:14.2f} {m['turn_ttft_p50_s']:11.3f} "
              f"{m['prefix_hit_rate']:9.3f}")  # fmt: skip
    ratios = {
        "sticky_vs_scorer_session_p90": med["prefix-aware"]["session_p90_s"] / med["sticky"]["session_p90_s"],
        "sticky_vs_round_robin_session_p90": med["round-robin"]["session_p90_s"]
        / med["sticky"]["session_p90_s"],
    }
    print("\n" + "\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor(),
            "command": "python benchmarks/agentic_affinity.py " + " ".join(sys.argv[1:]), "args": vars(args),
            "sticky_limit_tokens": limits}  # fmt: skip
    out = ROOT / "benchmarks" / "results" / "agentic_affinity.json"
    out.write_text(json.dumps({"meta": meta, "median": med, "ratios": ratios, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
