"""The host tier's blocks reach the shared prefix index as tier "cpu", the disk tier's as tier "disk": a
prefix the primary pool evicted but a tier keeps is still predicted, and scored as that tier's hit."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from services.common.kv.hashing import BlockHasher
from services.common.kv.prefix_index import PrefixIndex, PrefixMatch
from services.router.scheduling import Endpoint, RequestContext
from services.router.scheduling.scorers import DEFAULT_TIER_WEIGHTS, PrefixScorer
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.redis_server import redis_server  # noqa: F401 - fixture


def _wait(index: PrefixIndex, hashes: list[bytes], ok) -> PrefixMatch:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + 10
    while True:
        match = (index.lookup(hashes) or {}).get("engine-h") or PrefixMatch("engine-h", "")  # none: all 0
        if ok(match):
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


def _complete(engine, prompt: list[int]) -> list[int]:  # noqa: ANN001 - an InProcessEngine
    r = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _disk_engine(llama_dir: Path, redis_url: str, folder: Path):  # noqa: ANN202 - an InProcessEngine
    """16 primary blocks, 4 host slots, a disk tier of 12 block files: what the host tier evicts goes to disk."""
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block_size x KV heads x head_dim x fp32
    return start_in_process(
        llama_dir, "--redis-url", redis_url, "--engine-id", "engine-h", "--num-kv-blocks", "16",
        "--max-num-seqs", "2", "--kv-offload-cpu-bytes", str(4 * per_block),
        "--kv-offload-disk-path", str(folder), "--kv-offload-disk-bytes", str(12 * (per_block + 200)),
    )  # fmt: skip


def test_disk_tier_blocks_are_indexed_scored_evicted_and_reannounced(
    llama_dir: Path,
    redis_server,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A prefix the host tier demoted to disk is in the index as tier "disk" (scored at the disk weight by
    the router's scorer) and leaves it when the disk tier evicts it; a restarted engine re-announces what
    its disk kept, and serves it with the greedy tokens it computed the first time."""
    index = PrefixIndex.from_url(redis_server.url)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(100)] for _ in range(5)]  # A..E, 6 full blocks each
    hasher = BlockHasher(MODEL, 16)
    a = hasher.hash_tokens(prompts[0])
    engine = _disk_engine(llama_dir, redis_server.url, tmp_path / "kv")
    try:
        first = [_complete(engine, p) for p in prompts[:4]]  # each demotes the previous one's 4 host blocks
        match = _wait(index, a, lambda m: m.gpu == 0 and m.disk == 4)  # A: only on disk now
        assert (match.cpu, match.longest) == (0, 4)
        ctx = RequestContext.from_lookup(100, 16, index.lookup(a))
        [score] = PrefixScorer().score([Endpoint(engine.url)], ctx)
        assert score == pytest.approx(DEFAULT_TIER_WEIGHTS["disk"] * 4 / 6)
        first.append(_complete(engine, prompts[4]))  # a fourth demotion: A's files are the oldest, evicted
        _wait(index, a, lambda m: m.disk == 0)
    finally:
        engine.stop()
    kept = {bytes.fromhex(p.stem) for p in (tmp_path / "kv").glob("*.kvb")}
    assert len(kept) == 12
    restarted = _disk_engine(llama_dir, redis_server.url, tmp_path / "kv")
    try:
        for prompt in prompts:
            hashes = hasher.hash_tokens(prompt)
            on_disk = next((i for i, h in enumerate(hashes) if h not in kept), len(hashes))
            _wait(index, hashes, lambda m, n=on_disk: m.disk == n and m.gpu == 0)
        assert _complete(restarted, prompts[1]) == first[1]  # B: 4 blocks from disk, the same tokens
        blocks, failures = restarted.ctx.llm.engine.core.transfer_stats()
        assert blocks[("received", "disk")] >= 4
        assert set(failures) <= {"offload_dropped"}  # six blocks a prompt, four host slots: the tail dropped
        m = restarted.metrics()  # the per-tier series: hits, bytes, blocks held, load latency
        disk = blocks[("received", "disk")]
        assert m['kvferry_kv_tier_hit_tokens_total{tier="disk"}'] == disk * 16
        block_bytes = restarted.ctx.llm.engine.core.kv_block_bytes
        assert m['kvferry_kv_transfer_bytes_total{direction="received",path="disk"}'] == disk * block_bytes
        assert m['kvferry_kv_tier_blocks{tier="disk"}'] == 12 and m['kvferry_kv_tier_blocks{tier="cpu"}'] >= 4
        assert m['kvferry_kv_tier_load_seconds_count{tier="disk"}'] >= 1
        assert m['kvferry_kv_tier_load_seconds_bucket{le="+Inf",tier="disk"}'] >= 1
        assert m['kvferry_kv_tier_load_seconds_count{tier="kvstore"}'] == 0  # exported at 0: no store
        assert m['kvferry_kv_transfer_failures_total{reason="offload_queue_full"}'] == 0
    finally:
        restarted.stop()
