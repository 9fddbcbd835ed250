"""The issue's soak as a user would run it: `kvferry up` with SmolLM2 (router, 1 prefill + 1 decode over
NIXL, the kvstore, Redis) held at saturation by `kvferry bench serve --duration` (mixed shared-prefix and
random prompts, half streamed, 10% of clients disconnecting mid-stream, 5% invalid requests). Every
request answered as it must (bench serve exits 0), each process's RSS within 10% after warm-up, no KV
block in use and no file descriptor left open when idle, no traceback in any log; p99 TTFT per window.
Slow only (`make test-reliability`): $KVFERRY_SOAK_UP_S seconds (default 1800); with
$KVFERRY_SOAK_DIR set, the figures go there (soak-kvferry-up-pd.json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.engine.worker.loader.default_model import default_serving_model, gguf_tokenizer_dir
from tests.engine.entrypoints.helpers import REPO
from tests.monitoring.live_stack import kvferry_up
from tests.reliability.soak_load import ProcessProbe

IDLE_S = 7  # past the clients' and servers' 5 s keep-alive


def _stack_probes(pid: int) -> list[ProcessProbe]:
    """The stack's processes (children of `kvferry up`), named by what they run."""
    probes = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            words = [w.decode() for w in argv if w]
            name = next((w for w in ("kvstore", "router", "redis-server") if any(w in x for x in words)), "")
            if "serve" in words:
                name = "engine-" + words[words.index("--role") + 1] if "--role" in words else "engine"
            probes.append(ProcessProbe(name or " ".join(words[:3]), int(child)))
    return probes


def _metrics_urls(targets: Path) -> dict[str, str]:
    """pod -> /metrics URL of every engine, from the stack's Prometheus file_sd targets."""
    return {
        group["labels"]["pod"]: f"http://{group['targets'][0]}/metrics"
        for group in json.loads(targets.read_text())
        if group["labels"]["role"] in ("prefill", "decode", "engine")
    }


def _bench(url: str, seconds: float, out: Path, tokenizer: Path) -> dict:
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "serve", "--url", url, "--duration", str(seconds),
        "--max-concurrency", "24", "--dataset", "mixed", "--num-prompts", "256", "--prefix-len", "192",
        "--num-prefixes", "4", "--input-len", "48", "--output-len", "48", "--tokenizer", str(tokenizer),
        "--stream-fraction", "0.5", "--disconnect-fraction", "0.1", "--bad-fraction", "0.05",
        "--window", str(max(10.0, seconds / 6)), "--timeout", "120", "--no-progress", "--result-json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=seconds + 600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["summary"]


def _idle(engines: dict[str, str], probes: list[ProcessProbe], url: str) -> dict[str, tuple[float, int]]:
    """Wait until no engine holds a KV block or runs a request; every process's (RSS MB, fds)."""
    deadline = time.monotonic() + 60
    for metrics in engines.values():
        while True:
            text = httpx.get(metrics, timeout=10).text
            values = {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln and ln[0] != "#"}
            if (
                values.get("kvferry_kv_cache_usage_ratio") == 0
                and values.get("kvferry_num_requests_running") == 0
            ):
                break
            assert time.monotonic() < deadline, f"{metrics}: KV or requests still in use when idle"
            time.sleep(1)
    time.sleep(IDLE_S)
    return {p.name: (p.rss_mb(), p.fds()) for p in probes}


@pytest.mark.slow
@pytest.mark.timeout(4200)
def test_kvferry_up_with_smollm2_under_bench_serve(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVFERRY_SOAK_UP_S", "1800"))
    model, _ = default_serving_model()
    folder = os.environ.get("KVFERRY_SOAK_DIR")
    try:
        _soak(tmp_path, model, seconds, folder)
    finally:
        for log in tmp_path.glob("*.log") if folder else ():  # kept for a failed run's post-mortem
            shutil.copy(log, Path(folder or ".") / f"soak-kvferry-up-{log.name}")


def _soak(tmp_path: Path, model: Path, seconds: float, folder: str | None) -> None:
    with kvferry_up(model, tmp_path, "--prefill", "1", "--decode", "1") as stack:
        probes = _stack_probes(stack.pid)
        assert {"engine-prefill", "engine-decode", "router", "kvstore"} <= {p.name for p in probes}, probes
        engines = _metrics_urls(stack.targets)
        tokenizer = gguf_tokenizer_dir(model)
        warm = _bench(stack.url, 120, tmp_path / "warm.json", tokenizer)  # shapes, allocators, caches
        base = _idle(engines, probes, stack.url)
        summary = _bench(stack.url, seconds, tmp_path / "soak.json", tokenizer)
        end = _idle(engines, probes, stack.url)
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    figures = {
        "seconds": seconds,
        "warm_up_requests": warm["completed"],
        "requests": summary["completed"] + summary["failed"],
        "failed": summary["failed"],
        "kinds": summary["kinds"],
        "output_tok_s": round(summary["output_throughput"], 1),
        "windows": summary["windows"],
        "rss_mb": {n: [round(base[n][0]), round(end[n][0])] for n in base},
        "fds": {n: [base[n][1], end[n][1]] for n in base},
    }
    print("\nsoak:", json.dumps(figures, indent=1))
    if folder:
        (Path(folder) / "soak-kvferry-up-pd.json").write_text(json.dumps(figures, indent=1) + "\n")
    assert summary["failed"] == 0 and set(summary["kinds"]) == {"stream", "json", "dropped", "bad"}
    # The router's Redis pool keeps as many connections as lookups were ever in flight at once; a
    # connection Redis still holds open is pooled, not leaked, so the router may grow by what Redis grew.
    pooled = max(0, end["redis-server"][1] - base["redis-server"][1])
    for name in base:
        assert end[name][0] < base[name][0] * 1.10, (name, base[name], end[name])  # RSS flat
        if name != "redis-server":  # Redis's fds are our clients' pooled connections
            slack = 4 + (pooled if name == "router" else 0)
            assert end[name][1] <= base[name][1] + slack, (name, base[name], end[name])  # no fd leaked
    assert not [name for name, text in logs.items() if "Traceback" in text]
