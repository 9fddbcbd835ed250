"""A real `kvferry serve --redis-url` publishes its prefix-cache blocks; the shared index finds them."""

from __future__ import annotations

import time
from pathlib import Path

from services.common.kv.hashing import BlockHasher
from services.common.kv.prefix_index import PrefixIndex
from tests.engine.entrypoints.helpers import MODEL, start_server
from tests.redis_server import redis_server  # noqa: F401 - fixture


def test_engine_publishes_blocks_and_deregisters_on_exit(
    llama_dir: Path,
    tmp_path: Path,
    redis_server,  # noqa: F811
) -> None:
    server = start_server(
        llama_dir, tmp_path, "--redis-url", redis_server.url, "--engine-id", "engine-a", "--block-size", "16"
    )
    index = PrefixIndex.from_url(redis_server.url)
    prompt = list(range(3, 70))  # 67 tokens: 4 full blocks
    hashes = BlockHasher(MODEL, 16).hash_tokens(prompt)
    try:
        with server.http() as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while True:
            matches = index.lookup(hashes)
            if matches and matches.get("engine-a") and matches["engine-a"].longest == 4:
                break
            assert time.monotonic() < deadline, f"blocks never appeared in the index: {matches}"
            time.sleep(0.05)
        assert matches["engine-a"].url == server.url and matches["engine-a"].gpu == 4
        salted = BlockHasher(MODEL, 16).hash_tokens(prompt)[:1] + [b"\x00" * 32]
        assert index.lookup(salted)["engine-a"].longest == 1
    finally:
        assert server.stop() == 0
    assert "engine-a" not in (index.lookup(hashes) or {}), "a stopped engine must stop counting at once"
