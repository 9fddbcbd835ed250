"""The host tier's blocks reach the shared prefix index as tier "cpu": a prefix the primary pool evicted
but the host tier keeps is still predicted, and scored as a host-memory hit, not a primary one."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx

from services.common.kv.hashing import BlockHasher
from services.common.kv.prefix_index import PrefixIndex
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.redis_server import redis_server  # noqa: F401 - fixture


def _wait(index: PrefixIndex, hashes: list[bytes], ok) -> object:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + 10
    while True:
        match = (index.lookup(hashes) or {}).get("engine-h")
        if match is not None and ok(match):
            return match
        assert time.monotonic() < deadline, f"the index never showed it: {match}"
        time.sleep(0.05)


def test_host_tier_blocks_are_indexed_as_cpu(llama_dir: Path, redis_server) -> None:  # noqa: F811
    engine = start_in_process(
        llama_dir, "--redis-url", redis_server.url, "--engine-id", "engine-h", "--num-kv-blocks", "16",
        "--max-num-seqs", "2", "--kv-offload-cpu-bytes", str(2**22),
    )  # fmt: skip
    index = PrefixIndex.from_url(redis_server.url)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(100)] for _ in range(4)]
    hashes = BlockHasher(MODEL, 16).hash_tokens(prompts[0])  # 6 full blocks
    try:
        for prompt in prompts:  # one at a time: each evicts the one before from the primary pool
            r = httpx.post(
                f"{engine.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            if prompt is prompts[0]:
                _wait(index, hashes, lambda m: m.gpu == 6 and m.cpu == 6)
        match = _wait(index, hashes, lambda m: m.gpu == 0)
        assert match.cpu == 6 and match.longest == 6  # still predicted: from host memory
    finally:
        engine.stop()
