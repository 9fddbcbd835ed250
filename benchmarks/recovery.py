"""Recovery under kill -9 or drain: greedy streams through `kvferry up` (2 aggregated engines, or
`--pd`: 1 prefill + 2 decode engines) while one engine is disturbed every --every seconds: `--disturb kill`
sends SIGKILL, `--disturb drain` sends SIGTERM (a drain: in P/D the decode hands its streams' KV to the
other decode). Every stream is compared token for token (its text) with the same request in an
undisturbed run first.

Measures: failed client requests, streams whose text differs from the undisturbed one (a duplicated or
missing token), migrations by outcome (the router's `kvferry_router_migrations_total`: `moved` = the KV
moved, `resumed` = recomputed), the share of migrated streams whose KV moved, engine restarts by
`kvferry up`, and TTFT p50/p99 of steady requests vs requests started within 10 s after a disturbance.
A disturbance waits until the previous victim serves again. Writes benchmarks/results/recovery*.json.
Usage: python benchmarks/recovery.py [--pd] [--disturb kill|drain] [--duration 120] [--every 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["a lighthouse", "the sea", "a robot", "winter", "a market", "trains", "a garden", "the moon"]


@dataclass
class Result:
    prompt: int
    started: float
    ttft_s: float | None
    text: str
    error: str | None
    migrations: int


def _up(log_dir: Path, model: str | None, pd: bool, dtype: str) -> tuple[subprocess.Popen[str], str]:
    engines = ["--prefill", "1", "--decode", "2"] if pd else ["--engines", "2"]
    cmd = [sys.executable, "-m", "services.cli", "up", *([model] if model else []), *engines,
           "--port", "0", "--no-kvstore", "--log-dir", str(log_dir),
           "--serve-args", f"--dtype {dtype}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    url = None
    for line in proc.stdout:
        if m := re.search(r"OpenAI API at (http://\S+)/v1", line):
            url = m.group(1)
        if "Press Ctrl-C" in line:
            break
    if url is None:
        proc.kill()
        raise RuntimeError(f"kvferry up did not start: see {log_dir}")
    return proc, url


def _engine_pids(up: subprocess.Popen[str]) -> dict[str, tuple[int, str]]:
    """Engine name -> (pid, its URL)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(up.pid)], capture_output=True, text=True).stdout
    pids = {}
    for pid in map(int, out.split()):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--engine-id" in argv:
            port = argv[argv.index(b"--port") + 1].decode()
            pids[argv[argv.index(b"--engine-id") + 1].decode()] = (pid, f"http://127.0.0.1:{port}")
    return pids


async def _one(client: httpx.AsyncClient, url: str, i: int, model_body: dict) -> Result:
    body = {**model_body, "prompt": f"Write a short story about {TOPICS[i % len(TOPICS)]}.", "stream": True}
    started = time.monotonic()
    text, ttft, error, migrations = "", None, None, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(i, started, None, "", f"HTTP {r.status_code}", 0)
            async for line in r.aiter_lines():
                if line.startswith(": kvferry-migrations "):
                    migrations = int(line.split()[-1])
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    error = event["error"]["message"]
                for choice in event.get("choices") or []:
                    if choice.get("text") and ttft is None:
                        ttft = time.monotonic() - started
                    text += choice.get("text") or ""
    except httpx.HTTPError as exc:
        error = repr(exc)
    return Result(i, started, ttft, text, error, migrations)


async def _load(
    url: str, body: dict, n: int | None, duration: float | None, concurrency: int
) -> list[Result]:
    results: list[Result] = []
    counter = iter(range(10**9))
    end = time.monotonic() + duration if duration else None
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker() -> None:
            while True:
                i = next(counter)
                if (n is not None and i >= n) or (end is not None and time.monotonic() > end):
                    return
                results.append(await _one(client, url, i, body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _running(client: httpx.AsyncClient, engine: str) -> float:
    text = (await client.get(f"{engine}/metrics")).text
    found = re.search(r"^kvferry_num_requests_running (\S+)", text, re.M)
    return float(found.group(1)) if found else -1.0


async def _disturber(
    up: subprocess.Popen[str],
    url: str,
    args: argparse.Namespace,
    end: float,
    times: list[float],
    busy: list[float],
) -> None:
    """Every ``args.every`` s: SIGKILL or SIGTERM the busiest engine (the next one on a tie), as a disruption
    that matters would; ``busy``: its running requests just before."""
    turn, prefix = 0, "decode" if args.pd else "engine"
    sig = signal.SIGKILL if args.disturb == "kill" else signal.SIGTERM
    healthy = f"kvferry_router_healthy_endpoints {3.0 if args.pd else 2.0}"
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() + args.every < end:
            await asyncio.sleep(args.every)
            while healthy not in (await client.get(f"{url}/metrics")).text:  # the last victim serves again
                await asyncio.sleep(0.5)
            engines = {n: e for n, e in _engine_pids(up).items() if n.startswith(prefix)}
            load = {n: await _running(client, e[1]) for n, e in engines.items()}
            order = sorted(load, key=lambda n: (-load[n], (int(n.rsplit("-", 1)[1]) - turn) % len(load)))
            name = order[0]
            os.kill(engines[name][0], sig)
            times.append(time.monotonic())
            busy.append(load[name])
            print(f"{args.disturb}: {name} (pid {engines[name][0]}, {load[name]:g} running)", flush=True)
            turn += 1


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(int(q * len(values)), len(values) - 1)], 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint for kvferry up (default: its SmolLM2)")
    ap.add_argument("--pd", action="store_true", help="1 prefill + 2 decode engines (default: 2 aggregated)")
    ap.add_argument("--disturb", choices=["kill", "drain"], default="kill")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--every", "--kill-every", dest="every", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="engines' --dtype (fp32: bf16 greedy text depends on the batch's shape)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/recovery[-pd][-drain].json"
    )
    args = ap.parse_args()
    leg = ("-pd" if args.pd else "") + ("-drain" if args.disturb == "drain" else "")
    out = args.out or ROOT / "benchmarks" / "results" / f"recovery{leg}.json"
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as tmp:
        up, url = _up(Path(tmp), args.model, args.pd, args.dtype)
        try:
            reference = asyncio.run(_load(url, body, len(TOPICS), None, args.concurrency))
            want = {r.prompt % len(TOPICS): r.text for r in reference}
            times: list[float] = []
            busy: list[float] = []

            async def disturbed() -> list[Result]:
                end = time.monotonic() + args.duration
                disturber = asyncio.create_task(_disturber(up, url, args, end, times, busy))
                results = await _load(url, body, None, args.duration, args.concurrency)
                disturber.cancel()
                return results

            results = asyncio.run(disturbed())
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            up.send_signal(signal.SIGINT)
            said, _ = up.communicate(timeout=180)  # kvferry up's own lines: its restarts
    summary = {**_summary(results, reference, want, times, metrics, said), "running_at_disturbance": busy}
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other work (noisy)",
        "model": args.model or "kvferry up's default (SmolLM2-135M-Instruct Q4_1)",
        "engines": "1 prefill + 2 decode" if args.pd else "2 aggregated",
        "disturbance": "SIGKILL" if args.disturb == "kill" else "SIGTERM (drain)",
        "duration_s": args.duration,
        "every_s": args.every,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def _summary(
    results: list[Result],
    reference: list[Result],
    want: dict[int, str],
    times: list[float],
    metrics: str,
    said: str,
) -> dict[str, object]:
    near = [r for r in results if any(0 <= r.started - k <= 10 for k in times)]
    steady = [r.ttft_s for r in reference + [r for r in results if r not in near] if r.ttft_s is not None]
    migrated = {
        m: float(v)
        for m, v in re.findall(r'kvferry_router_migrations_total\{outcome="(\w+)"\} (\S+)', metrics)
    }
    moved_or_resumed = migrated.get("moved", 0.0) + migrated.get("resumed", 0.0)
    return {
        "requests": len(results),
        "failed": sum(r.error is not None for r in results),
        "text_differs_from_undisturbed": sum(
            r.error is None and r.text != want[r.prompt % len(TOPICS)] for r in results
        ),
        "disturbances": len(times),
        "streams_migrated": sum(r.migrations > 0 for r in results),
        "router_migrations": migrated,
        "kv_moved_share": round(migrated.get("moved", 0.0) / moved_or_resumed, 3)
        if moved_or_resumed
        else None,
        "engine_restarts": said.count("restarted (pid"),
        "ttft_steady_p50_s": _pct(steady, 0.5),
        "ttft_steady_p99_s": _pct(steady, 0.99),
        "ttft_after_disturbance_p50_s": _pct([r.ttft_s for r in near if r.ttft_s is not None], 0.5),
        "ttft_after_disturbance_p99_s": _pct([r.ttft_s for r in near if r.ttft_s is not None], 0.99),
    }


if __name__ == "__main__":
    main()
