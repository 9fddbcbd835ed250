"""The simulator against the real thing: one trace replayed on a real 3-engine `kvferry up` stack and run
through `kvferry sim` (3 engines, the committed timing model), TTFT p50/p90 and prefix hit rate side by side.

The trace is the agentic generator (sessions whose turns extend their own prefix), outputs capped so the
CPU run stays short. The real replay sends each row at its arrival time with the official `openai` client
(completions, prompt as token ids, streamed, ignore_eos) through the router, no kvstore (the simulator has
no kvstore tier); the hit rate is the engines' cached prompt tokens (usage.prompt_tokens_details) over
prompt tokens. Writes benchmarks/results/sim_validation.json.
Usage: python benchmarks/sim_validation.py [--engines 3] [--rate 0.1] [--duration 40] [--turns 4] [--max-output 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402

from services.sim.redis_process import RedisProcess  # noqa: E402
from services.sim.sim_report import percentiles  # noqa: E402
from services.sim.simulation import SimSettings, Simulation  # noqa: E402
from services.sim.timing_model import TimingModel  # noqa: E402
from services.sim.trace import TraceRow  # noqa: E402
from services.sim.trace_generators import GeneratorSettings, generate  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sim_validation.json"


def _up(log_dir: Path, engines: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "services.cli", "up", "--engines", str(engines), "--port", "0", "--no-kvstore",
           "--log-dir", str(log_dir)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"OpenAI API at (http://\S+)/v1", line):
            url = m.group(1)
        if "Press Ctrl-C" in line:
            break
    if url is None:
        proc.kill()
        raise RuntimeError(f"kvferry up did not start: see {log_dir}")
    return proc, url


async def _one(client: AsyncOpenAI, model: str, row: TraceRow, i: int, t0: float) -> tuple[float, int, int]:
    await asyncio.sleep(max(0.0, t0 + row.t - time.perf_counter()))
    prompt = row.tokens(i, 49152)
    start = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=row.output_len, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first, cached = None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return first if first is not None else float("nan"), cached, len(prompt)


async def replay(url: str, rows: list[TraceRow]) -> dict:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
    model = (await client.models.list()).data[0].id
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(client, model, r, i, t0) for i, r in enumerate(rows)))
    ttft = [r[0] for r in results]
    return {
        "ttft_s": percentiles(ttft),
        "hit_rate": round(sum(r[1] for r in results) / sum(r[2] for r in results), 4),
        "requests": len(rows),
    }


def simulate(rows: list[TraceRow], engines: int) -> dict:
    with RedisProcess() as redis_url:
        report = asyncio.run(
            Simulation(SimSettings(engines=engines), TimingModel.load(), redis_url).run(rows)
        )
    return {"ttft_s": report.ttft_s, "hit_rate": report.hit_rate, "requests": report.requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.1, help="sessions per second")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--engines", type=int, default=3)
    args = ap.parse_args()
    settings = GeneratorSettings(
        rate=args.rate, duration_s=args.duration, turns=args.turns, max_output=args.max_output, turn_gap_s=6.0
    )
    rows = generate("agentic", settings)
    t0 = time.time()
    sim = simulate(rows, args.engines)
    print("simulated", json.dumps(sim), flush=True)
    with tempfile.TemporaryDirectory() as logs:
        proc, url = _up(Path(logs), args.engines)
        try:
            real = asyncio.run(replay(url, rows))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print("real", json.dumps(real), flush=True)
    ratio = {
        "ttft_p50": round(sim["ttft_s"]["p50"] / real["ttft_s"]["p50"], 3),
        "ttft_p90": round(sim["ttft_s"]["p90"] / real["ttft_s"]["p90"], 3),
        "hit_rate": round(sim["hit_rate"] / real["hit_rate"], 3) if real["hit_rate"] else None,
    }
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "command": "python benchmarks/sim_validation.py " + " ".join(sys.argv[1:]),
        "trace": settings.model_dump(),
        "timing_model": TimingModel.load().source,
        "real": real,
        "simulated": sim,
        "simulated_over_real": ratio,
        "within_25_percent": {k: v is not None and 0.75 <= v <= 1.25 for k, v in ratio.items()},
    }
    result = json.loads(OUT.read_text()) if OUT.exists() else {"runs": {}}
    result["meta"] = {
        "date": run["date"],
        "machine": f"{platform.machine()}, 2 cores shared with other jobs (the real runs are noisy)",
        "note": "runs by engine count; one run each; each run names the timing model it simulated with",
    }
    result["runs"][f"{args.engines} engines"] = run
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(ratio))


if __name__ == "__main__":
    main()
