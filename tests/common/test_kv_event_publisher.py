"""KVEventPublisher against a real redis-server: batching, heartbeat, outages, resync, restart, close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.kv.hashing import BlockHasher
from services.common.kv.kv_event_publisher import KVEventPublisher, PublisherSettings
from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.common.kv.prefix_index import IndexSettings, PrefixIndex
from tests.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
PROMPT = BlockHasher("tiny", 4).hash_tokens(list(range(64)))  # 16 blocks
FAST = PublisherSettings(
    heartbeat_interval_s=0.1,
    retry_interval_s=0.1,
    redis_timeout_s=0.2,
    index=IndexSettings(heartbeat_ttl_s=1.5),  # 15 heartbeats: a loaded machine can pause one process 0.5 s
)


def stored(hashes: list[bytes], tier: str = "gpu") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 4, tier)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def index(redis_server: RedisServer) -> PrefixIndex:
    idx = PrefixIndex.from_url(redis_server.url, FAST.index)
    yield idx
    idx.close()


def gpu_run(index: PrefixIndex, engine_id: str = "e1") -> int | None:
    matches = index.lookup(PROMPT)
    return None if matches is None or engine_id not in matches else matches[engine_id].gpu


def test_steps_are_written_and_the_heartbeat_keeps_the_engine_alive(
    redis_server: RedisServer, index: PrefixIndex
) -> None:
    pub = KVEventPublisher(redis_server.url, "e1", "http://127.0.0.1:9001", settings=FAST)
    pub.publish([stored(PROMPT[:4])])
    pub.publish([stored(PROMPT[4:10]), BlockRemoved((PROMPT[8],))])
    pub.publish([])  # steps without events cost nothing
    assert pub.flush()
    assert index.lookup(PROMPT)["e1"].gpu == 8
    assert index.lookup(PROMPT)["e1"].url == "http://127.0.0.1:9001"
    time.sleep(3.0)  # twice the heartbeat TTL without any event
    assert gpu_run(index) == 8
    assert pub.stats.heartbeats >= 3 and pub.stats.batches_dropped == 0
    pub.close()
    assert gpu_run(index) is None  # a clean stop deregisters at once


def test_redis_down_drops_counts_and_resyncs_when_back(redis_server: RedisServer, index: PrefixIndex) -> None:
    pub = KVEventPublisher(redis_server.url, "e1", "http://e1", settings=FAST)
    pub.publish([stored(PROMPT[:4])])
    assert pub.flush()
    redis_server.stop()
    started = time.perf_counter()
    for i in range(4, 12):  # the engine keeps stepping while Redis is gone
        pub.publish([stored(PROMPT[i : i + 1])])
    pub.publish([AllBlocksCleared("cpu"), stored(PROMPT[:3], "cpu")])
    assert time.perf_counter() - started < 0.05  # publish only enqueues
    assert pub.flush()
    wait_for(lambda: pub.stats.batches_dropped >= 1)
    assert pub.stats.redis_errors >= 1
    redis_server.start()  # an empty Redis: the publisher rewrites everything it holds
    wait_for(lambda: gpu_run(index) == 12)
    assert index.lookup(PROMPT)["e1"].cpu == 3
    assert pub.stats.resyncs >= 2
    pub.close()


def test_index_flushed_behind_the_publishers_back_is_repaired(
    redis_server: RedisServer, index: PrefixIndex
) -> None:
    pub = KVEventPublisher(redis_server.url, "e1", "http://e1", settings=FAST)
    pub.publish([stored(PROMPT[:6])])
    assert pub.flush()
    redis_server.client().flushall()  # no connection error: the heartbeat's seq check notices
    wait_for(lambda: gpu_run(index) == 6)
    pub.close()


CRASHING_ENGINE = """
import sys, time
from services.common.kv.hashing import BlockHasher
from services.common.kv.kv_event_publisher import KVEventPublisher
from services.common.kv.kv_events import BlockStored
prompt = BlockHasher("tiny", 4).hash_tokens(list(range(64)))
pub = KVEventPublisher(sys.argv[1], "e1", "http://e1")
pub.publish([BlockStored(tuple(prompt), None, (), 4)])
assert pub.flush()
print("ready", flush=True)
time.sleep(60)
"""


def test_restarted_engine_replaces_its_previous_instance(
    redis_server: RedisServer, index: PrefixIndex
) -> None:
    crashing = subprocess.Popen(
        [sys.executable, "-c", CRASHING_ENGINE, redis_server.url], stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        assert crashing.stdout.readline().strip() == "ready"
    finally:
        os.kill(crashing.pid, signal.SIGKILL)  # no clean shutdown: its entries stay behind
        crashing.wait()
    assert gpu_run(index) == 16
    new = KVEventPublisher(redis_server.url, "e1", "http://e1", settings=FAST)
    wait_for(lambda: not gpu_run(index))  # cleared: e1 holds none of it (absent from the answer)
    new.publish([stored(PROMPT[:2])])
    assert new.flush()
    assert gpu_run(index) == 2
    new.close()


def test_kvstore_publisher_files_default_tier_events_under_its_tier(
    redis_server: RedisServer, index: PrefixIndex
) -> None:
    pub = KVEventPublisher(redis_server.url, "store", "http://store", tier="kvstore", settings=FAST)
    pub.publish([stored(PROMPT[:5]), stored(PROMPT[:2], "cpu")])
    assert pub.flush()
    match = index.lookup(PROMPT)["store"]
    assert (match.gpu, match.cpu, match.kvstore) == (0, 2, 5)
    pub.close()


def test_close_is_bounded_when_redis_is_gone(redis_server: RedisServer) -> None:
    pub = KVEventPublisher(redis_server.url, "e1", "http://e1", settings=FAST)
    assert pub.flush()
    redis_server.stop()
    pub.publish([stored(PROMPT)])
    started = time.monotonic()
    pub.close()
    assert time.monotonic() - started < 2.0
    pub.publish([stored(PROMPT)])  # after close: ignored, no error
