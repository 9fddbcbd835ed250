"""The simulated kvstore tier: engines offload finished prompts into a shared LRU store and load missing
prefixes from it; its blocks reach the real Redis index as tier kvstore, credited to every engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis

from pool_operator.poolfile import load_pools
from services.cli import main as kvferry
from services.common.kv.prefix_index import PrefixIndex
from services.router.scheduling import RequestContext
from services.sim.pool_settings import pool_settings, pool_timing
from services.sim.sim_kvstore import SimKVStore
from services.sim.simulation import SIM_INDEX, SimSettings, Simulation
from services.sim.timing_model import TimingModel, TimingModelError
from services.sim.trace import TraceRow
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
DOCS = 12  # 12 documents of 32 blocks: more than two engines of 128 blocks hold, less than the store


def _trace() -> list[TraceRow]:
    """Questions over the documents in turn, far enough apart that the engines are idle between them."""
    return [
        TraceRow(t=4.0 * i, prompt_len=544, prefix_group=f"doc-{i % DOCS}", prefix_len=512, output_len=8)
        for i in range(3 * DOCS)
    ]


def _run(url: str | None, kvstore_blocks: int, seed: int = 0):
    timing = TimingModel.load().model_copy(update={"num_kv_blocks": 128})
    settings = SimSettings(engines=2, kvstore_blocks=kvstore_blocks, seed=seed, index_budget_s=5.0)
    return asyncio.run(Simulation(settings, timing, url).run(_trace()))


def test_a_working_set_beyond_the_engines_kv_is_served_from_the_kvstore(redis_server: RedisServer) -> None:
    without = _run(redis_server.url, 0)
    redis.Redis.from_url(redis_server.url).flushall()
    with_store = _run(redis_server.url, 2_000)
    assert without.completed == with_store.completed == 3 * DOCS
    assert without.kvstore is None and without.hit_rate < 0.1  # the engines' LRU keeps evicting the documents
    store = with_store.kvstore
    assert store is not None and store.evicted_blocks == 0
    assert store.stored_blocks >= DOCS * 32  # every document offloaded once computed
    assert store.hit_rate > 0.5 and store.loaded_blocks >= DOCS * 32  # later rounds (or a local hit)
    assert with_store.ttft_s["p50"] < without.ttft_s["p50"] / 2
    assert with_store.prompt_tokens == without.prompt_tokens


def test_a_small_kvstore_evicts_its_least_recently_used_blocks() -> None:
    report = _run(None, 100)  # three documents' worth: cycling through twelve, every lookup misses
    assert report.kvstore is not None and report.kvstore.held_blocks == 100
    assert report.kvstore.evicted_blocks > 0 and report.kvstore.hit_blocks == 0


def test_the_same_seed_gives_the_same_report_with_a_kvstore(redis_server: RedisServer) -> None:
    first = _run(redis_server.url, 2_000, seed=3)
    redis.Redis.from_url(redis_server.url).flushall()
    second = _run(redis_server.url, 2_000, seed=3)
    assert first.kvstore is not None and first.kvstore.hit_blocks > 0
    assert first.deterministic() == second.deterministic()


def test_the_store_reports_its_blocks_to_the_index_as_tier_kvstore(redis_server: RedisServer) -> None:
    index = PrefixIndex(redis.Redis.from_url(redis_server.url), SIM_INDEX)
    store = SimKVStore(3, index)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    store.put([a, b])
    assert store.match([a, b, c]) == 2
    ctx = RequestContext.from_lookup(48, 16, index.lookup([a, b, c]))
    assert ctx.store_blocks == 2  # a router credits them to every engine of the pool
    store.put([c, d])  # a was used least recently: evicted
    assert store.match([a]) == 0 and store.match([b, c, d]) == 3
    assert RequestContext.from_lookup(16, 16, index.lookup([a])).store_blocks == 0
    assert RequestContext.from_lookup(48, 16, index.lookup([b, c, d])).store_blocks == 3
    store.close()
    assert RequestContext.from_lookup(48, 16, index.lookup([b, c, d])).store_blocks == 0


def test_a_pools_kvstore_is_sized_in_the_timing_models_blocks() -> None:
    timing = TimingModel.load()
    pd = load_pools(ROOT / "examples" / "disaggregated-pool.yaml")[0]
    aggregated = load_pools(ROOT / "examples" / "aggregated-pool.yaml")[0]
    assert pd.spec.kvstore.enabled and not aggregated.spec.kvstore.enabled
    model = pool_timing(pd, timing)
    assert model.kv_bytes_per_block == timing.kv_bytes_per_block * pd.spec.engine.block_size // 16
    blocks = pool_settings(pd, SimSettings(), model).kvstore_blocks
    assert blocks == 64 * 2**30 // model.kv_bytes_per_block
    assert pool_settings(aggregated, SimSettings(), pool_timing(aggregated, timing)).kvstore_blocks == 0
    with pytest.raises(TimingModelError, match="kv_bytes_per_block"):
        pool_settings(pd, SimSettings(), model.model_copy(update={"kv_bytes_per_block": None}))


def test_a_disaggregated_pool_offloads_from_prefill(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    pool = ROOT / "examples" / "disaggregated-pool.yaml"
    argv = ["sim", "--pool", str(pool), "--trace", "rag", "--duration", "20", "--out", str(out)]
    assert kvferry(argv) == 0
    report = json.loads(out.read_text())
    assert report["disaggregated"] > 0 and report["kvstore"]["stored_blocks"] > 0
