"""benchmarks/kernels.py runs every row (attention, pointwise, end-to-end decode step) on tiny interpreted shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_benchmark_smoke_writes_every_row(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--smoke", "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "kernels-cpu-smoke.json").read_text())
    kinds = {r["kernel"] for r in result["rows"]}
    assert kinds == {
        "decode",
        "prefill",
        "rms_norm+residual",
        "rotary",
        "silu_and_mul",
        "reshape_and_cache",
        "decode_step",
    }
    for row in result["rows"]:
        assert row["ms"] > 0 and row["limit"], row
    step = next(r for r in result["rows"] if r["kernel"] == "decode_step")
    assert step["floor_ms"] > 0 and step["weight_bytes"] > 0 and step["kv_bytes"] > 0
    assert "end-to-end decode step" in proc.stdout
