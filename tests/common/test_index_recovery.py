"""Index recovery as a property (hypothesis, real redis-server): whatever mix of stored / removed / cleared
events an engine publishes, with the index wiped (Redis restarted empty) at any point between its batches,
once the publisher is quiet the index holds exactly the engine's blocks per tier: never a block the engine
dropped, never a block missing. (The boot id and the sequence numbers behind it: a new instance or a gap
clears the engine's entries until its snapshot lands, test_prefix_index.py; a restarted engine is never
credited with its previous instance's blocks, test_kv_event_publisher.py.)"""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.kv.hashing import BlockHasher
from services.common.kv.kv_event_publisher import KVEventPublisher
from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from services.common.kv.prefix_index import PrefixIndex
from tests.common.test_kv_event_publisher import FAST
from tests.redis_server import RedisServer

PROMPT = BlockHasher("tiny", 4).hash_tokens(list(range(48)))  # 12 blocks
TIERS = ("gpu", "cpu")

_span = st.tuples(st.integers(0, 11), st.integers(1, 6))
_op = st.one_of(
    st.tuples(st.just("store"), _span, st.sampled_from(TIERS)),
    st.tuples(st.just("remove"), _span, st.sampled_from(TIERS)),
    st.tuples(st.just("clear"), st.just((0, 0)), st.sampled_from(TIERS)),
    st.tuples(st.just("wipe"), st.just((0, 0)), st.just("gpu")),  # Redis loses everything
)


def _event(kind: str, start: int, length: int, tier: str) -> KVEvent:
    hashes = tuple(PROMPT[start : start + length])
    if kind == "store":
        return BlockStored(hashes, None, (), 4, tier)  # type: ignore[arg-type]
    if kind == "remove":
        return BlockRemoved(hashes, tier)  # type: ignore[arg-type]
    return AllBlocksCleared(tier)  # type: ignore[arg-type]


def _leading(held: set[bytes]) -> int:
    n = 0
    while n < len(PROMPT) and PROMPT[n] in held:
        n += 1
    return n


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(_op, min_size=1, max_size=4), min_size=1, max_size=6))
def test_the_index_converges_to_the_engines_blocks(redis_server: RedisServer, batches: list) -> None:
    redis = redis_server.client()
    redis.flushall()
    index = PrefixIndex.from_url(redis_server.url, FAST.index)
    pub = KVEventPublisher(redis_server.url, "e1", "http://e1", settings=FAST)
    model: dict[str, set[bytes]] = {t: set() for t in TIERS}
    try:
        for batch in batches:
            events = []
            for kind, (start, length), tier in batch:
                if kind == "wipe":
                    redis.flushall()
                    continue
                event = _event(kind, start, length, tier)
                events.append(event)
                held = model[tier]
                if isinstance(event, AllBlocksCleared):
                    held.clear()
                elif isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                else:
                    held.difference_update(event.block_hashes)
            pub.publish(events)
        assert pub.flush()
        want = (_leading(model["gpu"]), _leading(model["cpu"]))
        deadline = time.monotonic() + 5
        while True:
            match = (index.lookup(PROMPT) or {}).get("e1")
            got = (match.gpu, match.cpu) if match else None
            if got == want or (want == (0, 0) and got is None):
                break
            assert time.monotonic() < deadline, (got, want)
            time.sleep(0.02)
    finally:
        pub.close()
        index.close()
