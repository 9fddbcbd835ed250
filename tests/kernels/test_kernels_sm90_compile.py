"""Without a GPU: compile the real launches of every kernel for sm_90 (H100) with Triton's NVIDIA backend."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile_check.py")
ROOT = SCRIPT.parents[2]


def run_compile_check(tmp_path: Path, *flags: str) -> str:
    """Run the check in a fresh process (no interpreter, empty Triton cache) and return its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_kernels_compile_for_sm90_bf16(tmp_path: Path) -> None:
    report = run_compile_check(tmp_path, "--quick")
    assert "compiled 22 launches" in report
    attention = [line for line in report.splitlines() if line.startswith(("_prefill", "_decode_split"))]
    assert len(attention) == 3 and all("spill_stores=0" in line for line in attention), report
    dequant = [line for line in report.splitlines() if line.startswith("_dequant_matmul")]
    assert len(dequant) == 2 and all("spill_stores=0" in line for line in dequant), report
    moe = [line for line in report.splitlines() if line.startswith("_moe_")]  # one per tile config, x2
    assert len(moe) == 8 and all("spill_stores=0" in line for line in moe), report


@pytest.mark.slow
def test_kernels_compile_for_sm90_all_dtypes_and_head_dims(tmp_path: Path) -> None:
    assert "compiled 109 launches" in run_compile_check(tmp_path)
