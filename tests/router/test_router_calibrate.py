"""``kvferry router calibrate`` against a real engine: levels measured, the bend's token load written to the
pool's Redis where every replica's SessionAffinity reads it; the knee rule; bad flags."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import redis.asyncio as aioredis

from services.router.sessions.calibrate_cli import Level, knee
from services.router.sessions.session_affinity import LIMIT_KEY, SessionAffinity
from tests.engine.entrypoints.helpers import REPO
from tests.engine_harness import start_in_process
from tests.redis_server import RedisServer


def test_knee_is_the_load_before_ttft_bends() -> None:
    levels = [Level(1, 0.10, 100.0), Level(2, 0.12, 210.0), Level(4, 0.15, 400.0), Level(8, 0.35, 800.0)]
    assert knee(levels, 2.0) == 400.0
    assert knee(levels, 5.0) == 800.0  # no bend: the most it carried


def test_calibrate_writes_the_pool_limit(llama_dir: Path, redis_server: RedisServer) -> None:
    engine = start_in_process(llama_dir, "--max-model-len", "512", "--num-kv-blocks", "64")
    try:
        cmd = [sys.executable, "-m", "services.cli", "router", "calibrate", "--engine", engine.url]
        cmd += [
            "--redis-url",
            redis_server.url,
            "--levels",
            "1,4",
            "--prompt-words",
            "20",
            "--max-tokens",
            "48",
            "--bend",
            "100",  # no bend on this scale: the limit is the most load measured
        ]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        engine.stop()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4] and result["written"]
    assert all(lv["ttft_p50_s"] > 0 for lv in result["levels"]) and result["limit_tokens"] > 0
    assert float(redis_server.client().get(LIMIT_KEY)) == result["limit_tokens"]

    async def read() -> float | None:
        kv = aioredis.Redis.from_url(redis_server.url)
        try:
            return await SessionAffinity(kv, 60, limit_tokens=1.0).limit()
        finally:
            await kv.aclose()

    assert asyncio.run(read()) == result["limit_tokens"]


def test_bad_levels_name_the_flag() -> None:
    cmd = [sys.executable, "-m", "services.cli", "router", "calibrate", "--engine", "http://127.0.0.1:1"]
    out = subprocess.run([*cmd, "--levels", "0,x"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--levels" in out.stderr
    down = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "error" in down.stderr and "Traceback" not in down.stderr
