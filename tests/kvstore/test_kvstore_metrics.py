"""Real `kvferry kvstore` processes: /metrics scraped over a socket (exact counters, gauges), /health, off switch."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

pytest.importorskip("grpc")  # the kvstore extra
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable  # noqa: E402
from tests.kvstore_server import KVStoreProcess, kvstore_process  # noqa: E402

BLOCK_SIZE = 16
BLOCK_BYTES = 64 << 10
ACCOUNTED = BLOCK_BYTES + 4 * BLOCK_SIZE  # the store counts block data plus uint32 token ids

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _tokens(i: int) -> list[int]:
    return list(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))


def _block(i: int, nbytes: int = BLOCK_BYTES) -> tuple[bytes, list[int], bytes]:
    return _hash(i), _tokens(i), bytes([i % 256]) * nbytes


def scrape(metrics_url: str) -> Samples:
    """Every sample of GET /metrics, keyed by (name, sorted labels)."""
    response = httpx.get(f"{metrics_url}/metrics", timeout=5.0)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _delta(after: Samples, before: Samples) -> Samples:
    return {key: v - before.get(key, 0.0) for key, v in after.items()}


def _free_port_pair() -> int:
    """A port P such that P and P + 1 are free on 127.0.0.1 (now)."""
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def store() -> Iterator[KVStoreProcess]:
    """One store on an explicit gRPC port, metrics on the default port, blocks in an arena (no NIXL)."""
    with kvstore_process(
        "--port", str(_free_port_pair()), "--slot-bytes", str(BLOCK_BYTES), "--no-nixl", capacity_gb="0.01"
    ) as running:
        yield running


def test_metrics_default_to_grpc_port_plus_one_with_health(store: KVStoreProcess) -> None:
    port = int(store.target.rsplit(":", 1)[1])
    assert store.metrics_url == f"http://127.0.0.1:{port + 1}"
    health = httpx.get(f"{store.metrics_url}/health", timeout=5.0)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{store.metrics_url}/nope", timeout=5.0).status_code == 404
    s = scrape(store.metrics_url)
    assert value(s, "kvferry_kvstore_capacity_bytes") == 10_000_000
    assert (
        value(s, "kvferry_kvstore_rpc_errors_total", method="Put") == 0
    )  # every method's series exists from the start


def test_counters_count_every_block_requested(store: KVStoreProcess) -> None:
    before = scrape(store.metrics_url)
    with KVStoreClient(store.target) as client:
        assert client.put(_block(i) for i in range(4)).stored == 4
        assert client.put(_block(i) for i in range(2)).present == 2  # already there: not counted as puts
        assert len(client.get([(_hash(i), _tokens(i)) for i in range(4)])) == 4  # 4 hits
        other = [
            (_hash(0), _tokens(0)),
            (_hash(1), _tokens(7)),
            (_hash(2), _tokens(2)),
            (_hash(3), _tokens(3)),
        ]
        assert len(client.get(other)) == 1  # 1 hit, 1 token mismatch, 2 misses (the prefix ended at block 1)
        assert client.get([(_hash(99), _tokens(99))]) == []  # 1 miss
        pins = [
            (_hash(0), _tokens(0)),
            (_hash(1), _tokens(1)),
            (_hash(2), _tokens(9)),
            (_hash(3), _tokens(3)),
        ]
        assert len(client.pin_prefix(pins)) == 2  # pins are gets too: 2 hits, 1 token mismatch, 1 miss
        with pytest.raises(KVStoreUnavailable):
            client.nixl_handshake("{}")  # --no-nixl: FAILED_PRECONDITION
    s = _delta(scrape(store.metrics_url), before)
    assert value(s, "kvferry_kvstore_puts_total") == 4
    assert value(s, "kvferry_kvstore_put_bytes_total") == 4 * BLOCK_BYTES
    assert value(s, "kvferry_kvstore_gets_total", result="hit") == 5 + 2
    assert value(s, "kvferry_kvstore_gets_total", result="miss") == 3 + 1
    assert value(s, "kvferry_kvstore_gets_total", result="token_mismatch") == 1 + 1
    assert value(s, "kvferry_kvstore_blocks") == 4
    assert value(s, "kvferry_kvstore_bytes_used") == 4 * ACCOUNTED
    assert value(s, "kvferry_kvstore_evictions_total") == 0
    methods = ("Put", "Get", "PinPrefix", "NixlHandshake", "Exists")
    calls = {m: value(s, "kvferry_kvstore_rpc_duration_seconds_count", method=m) for m in methods}
    assert calls == {"Put": 2, "Get": 3, "PinPrefix": 1, "NixlHandshake": 1, "Exists": 0}
    errors = {m: value(s, "kvferry_kvstore_rpc_errors_total", method=m) for m in methods}
    assert errors == {"Put": 0, "Get": 0, "PinPrefix": 0, "NixlHandshake": 1, "Exists": 0}


def test_gauges_follow_evictions() -> None:
    big, bigger = 600_000, 900_000
    with kvstore_process(capacity_gb="0.001") as store, KVStoreClient(store.target) as client:

        def put_and_scrape(i: int, nbytes: int = BLOCK_BYTES) -> tuple[float, float, float]:
            assert client.put([_block(i, nbytes)]).stored == 1
            s = scrape(store.metrics_url)
            return tuple(
                value(s, f"kvferry_kvstore_{n}") for n in ("blocks", "bytes_used", "evictions_total")
            )

        assert put_and_scrape(100, big) == (1, big + 64, 0)
        for i in range(5):
            put_and_scrape(i)
        assert put_and_scrape(5) == (7, big + 64 + 6 * ACCOUNTED, 0)  # 993,664 of 1,000,000 bytes
        assert put_and_scrape(6) == (7, 7 * ACCOUNTED, 1)  # the big block went: bytes down
        assert put_and_scrape(101, bigger) == (
            2,
            ACCOUNTED + bigger + 64,
            7,
        )  # six small ones went: blocks down


def test_metrics_port_zero_turns_metrics_off() -> None:
    port = _free_port_pair()
    with (
        kvstore_process("--port", str(port), "--metrics-port", "0") as store,
        KVStoreClient(store.target) as client,
    ):
        assert store.metrics_url is None
        assert client.exists([_hash(0)]) == 0  # the store itself serves
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port + 1}/metrics", timeout=2.0)
