"""The pool ConfigMap's hash version reaches every pod (KVFERRY_HASH_VERSION) and is checked at start: a pod
of another hashing version refuses to start, naming the variable, instead of silently never sharing KV."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.kv.hashing import HASH_VERSION, check_pool_hash_version

REPO = Path(__file__).resolve().parents[2]


def test_the_check() -> None:
    check_pool_hash_version({})
    check_pool_hash_version({"KVFERRY_HASH_VERSION": str(HASH_VERSION)})
    with pytest.raises(ValueError, match="KVFERRY_HASH_VERSION='99'"):
        check_pool_hash_version({"KVFERRY_HASH_VERSION": "99"})


@pytest.mark.parametrize(
    "args",
    [("router", "--tokenizer", "/nonexistent", "--engine", "http://127.0.0.1:9"), ("serve", "/nonexistent")],
)
def test_router_and_engine_refuse_another_version(args: tuple[str, ...]) -> None:
    env = {**os.environ, "KVFERRY_HASH_VERSION": "99", "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "KVFERRY_HASH_VERSION='99'" in run.stderr, run.stderr[-2000:]
