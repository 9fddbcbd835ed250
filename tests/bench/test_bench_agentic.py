"""``kvferry bench serve --dataset agentic`` against a real engine behind a real router with session
affinity: every turn and sub-agent sent with its session, histories reused (prefix hits), the summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from services.bench.serve import BenchConfig
from tests.engine.entrypoints.helpers import REPO
from tests.engine_harness import start_in_process
from tests.router.stack import start_router


def test_agentic_sessions_through_a_router(llama_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(llama_dir, "--max-model-len", "1024")
    router = start_router(llama_dir, tmp_path, [engine.url], "--session-affinity")
    try:
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "bench",
            "serve",
            "--url",
            router.url,
            "--dataset",
            "agentic",
        ]
        cmd += [
            "--num-prompts",
            "2",
            "--turns",
            "3",
            "--subagents",
            "1",
            "--prefix-len",
            "48",
            "--input-len",
            "8",
        ]
        cmd += ["--output-len", "4", "--tool-pause", "0.01", "--vocab-size", "200", "--no-progress"]
        cmd += ["--result-json", str(tmp_path / "agentic.json")]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        state = httpx.get(f"{router.url}/ui/state", params={"decisions": 20}, timeout=10).json()
    finally:
        router.stop()
        engine.stop()
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "agentic.json").read_text())["summary"]
    assert summary["requests"] == 2 * (3 + 1 * 2) and summary["failed"] == 0  # turns + a sub-agent's two
    assert summary["prefix_hit_rate"] > 0.3  # the system prompt and each history come back
    assert 0 < summary["turn_ttft_p50_s"] <= summary["session_p50_s"]
    assert "session p90 s" in out.stdout
    sessions = {d["session"] for d in state["decisions"]}
    assert {"public:s0", "public:s1", "public:s0/a0", "public:s1/a0"} <= sessions


def test_agentic_paces_itself() -> None:
    with pytest.raises(ValidationError, match="paces itself"):
        BenchConfig(dataset="agentic", request_rate=5.0)
