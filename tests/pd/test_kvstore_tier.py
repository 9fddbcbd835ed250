"""The kvstore as the shared prefix tier: engines offload blocks, a cold engine fetches a prefix it lacks,
P/D falls back to it without NIXL, and a dead store never stops an engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.kv.hashing import BlockHasher
from services.common.kv.kvstore_client import KVStoreClient
from services.common.pool.prom_text import scan_samples
from tests.engine.entrypoints.helpers import MODEL, free_port
from tests.engine_harness import start_in_process
from tests.kvstore_server import KVStoreProcess, kvstore_process, running_kvstore
from tests.pd.test_pd_flow import complete, prompts
from tests.redis_server import redis_server  # noqa: F401 - fixture

ARGS = ("--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "512")


@pytest.fixture(scope="module")
def store_process() -> Iterator[KVStoreProcess]:
    with kvstore_process(capacity_gb="0.2") as store:
        yield store


@pytest.fixture(scope="module")
def kvstore(store_process: KVStoreProcess) -> str:
    return f"grpc://{store_process.target}"


def _rpc_calls(store: KVStoreProcess) -> dict[str, float]:
    """gRPC calls the store served so far, by method (from its /metrics)."""
    text = httpx.get(f"{store.metrics_url}/metrics", timeout=5).text
    return {
        s.labels["method"]: s.value
        for s in scan_samples(text, "kvferry_kvstore_rpc_duration_seconds_count".__eq__)
    }


def _wait_stored(store: str, prompt: list[int], n_blocks: int) -> None:
    hashes = BlockHasher(MODEL, 16).hash_tokens(prompt)[:n_blocks]
    deadline = time.monotonic() + 10
    with KVStoreClient(store) as client:
        while client.exists(hashes) < n_blocks:
            assert time.monotonic() < deadline, "blocks never reached the kvstore"
            time.sleep(0.05)


def _blocks(server, direction: str, path: str) -> float:
    return server.metrics().get(
        f'kvferry_kv_transfer_blocks_total{{direction="{direction}",path="{path}"}}', 0
    )


def test_second_engine_gets_the_prefix_from_the_store(
    llama_dir: Path, kvstore: str, store_process: KVStoreProcess
) -> None:
    """Both sides have NIXL: the store pins the prefix and the engine READs the slots (no gRPC Get)."""
    a = start_in_process(llama_dir, "--kvstore-url", kvstore, *ARGS)
    b = start_in_process(llama_dir, "--kvstore-url", kvstore, *ARGS)
    try:
        prompt = prompts(1, seed=21)[0] + list(range(3, 120))
        first = complete(a, prompt)
        _wait_stored(kvstore, prompt, (len(prompt) - 1) // 16)
        before = _rpc_calls(store_process)
        second = complete(b, prompt)
        after = _rpc_calls(store_process)
        assert after["PinPrefix"] > before["PinPrefix"] and after["Get"] == before["Get"]
        assert "NIXL READs" in b.log_text()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16
        assert _blocks(b, "received", "kvstore") == (len(prompt) - 1) // 16
        assert _blocks(a, "sent", "kvstore") >= (len(prompt) - 1) // 16
        m = b.metrics()  # one kvstore load, its latency observed; its tokens counted as tier hits
        assert m['kvferry_kv_tier_load_seconds_count{tier="kvstore"}'] == 1
        assert m['kvferry_kv_tier_hit_tokens_total{tier="kvstore"}'] == (len(prompt) - 1) // 16 * 16
    finally:
        a.stop()
        b.stop()


def test_pd_without_nixl_moves_kv_through_the_store(
    llama_dir: Path, kvstore: str, store_process: KVStoreProcess
) -> None:
    prefill = start_in_process(llama_dir, "--role", "prefill", "--no-nixl", "--kvstore-url", kvstore, *ARGS)
    decode = start_in_process(llama_dir, "--role", "decode", "--no-nixl", "--kvstore-url", kvstore, *ARGS)
    aggregated = start_in_process(llama_dir, *ARGS)
    try:
        for prompt in prompts(6, seed=22):
            params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
            _wait_stored(kvstore, prompt, len(params["remote_block_ids"]))
            out = complete(decode, prompt, params)
            assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"]
        assert _blocks(decode, "received", "kvstore") > 0
        assert prefill.metrics()["kvferry_kv_cache_usage_ratio"] == 0.0  # no NIXL lease held
        assert _rpc_calls(store_process)["Get"] > 0  # engines without NIXL fetch over gRPC
    finally:
        for s in (prefill, decode, aggregated):
            s.stop()


def test_engine_keeps_serving_when_the_store_is_down(llama_dir: Path) -> None:
    dead = f"grpc://127.0.0.1:{free_port()}"
    server = start_in_process(llama_dir, "--kvstore-url", dead, *ARGS)
    try:
        for prompt in prompts(3, seed=23):
            assert complete(server, prompt)["choices"][0]["finish_reason"] == "length"
        m = server.metrics()
        assert m.get('kvferry_kv_transfer_failures_total{reason="kvstore_unavailable"}', 0) >= 1
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()


def test_kvstore_reports_its_blocks_to_the_prefix_index(llama_dir: Path, redis_server) -> None:  # noqa: F811
    from services.common.kv.prefix_index import PrefixIndex
    from services.router.scheduling.context import RequestContext
    from services.router.scheduling.endpoint import Endpoint

    with running_kvstore("--redis-url", redis_server.url, capacity_gb="0.05") as target:
        engine = start_in_process(llama_dir, "--kvstore-url", f"grpc://{target}", *ARGS)
        try:
            prompt = prompts(1, seed=31)[0] + list(range(3, 100))
            complete(engine, prompt)
            n = (len(prompt) - 1) // 16
            _wait_stored(f"grpc://{target}", prompt, n)
            hashes = BlockHasher(MODEL, 16).hash_tokens(prompt)
            index = PrefixIndex.from_url(redis_server.url)
            deadline = time.monotonic() + 10
            while not any(m.kvstore == n for m in (index.lookup(hashes) or {}).values()):
                assert time.monotonic() < deadline, index.lookup(hashes)
                time.sleep(0.05)
            store_row = next(m for m in index.lookup(hashes).values() if m.url.startswith("grpc://"))
            assert store_row.url == f"grpc://{target}" and store_row.gpu == 0
            # a router credits that prefix to every engine of the pool (each can fetch it)
            ctx = RequestContext.from_lookup(len(prompt), 16, index.lookup(hashes))
            other = Endpoint("http://10.9.9.9:8000", "both", healthy=True)
            assert ctx.match(other).kvstore == n and ctx.cached_tokens(other) == n * 16
            index.close()
        finally:
            engine.stop()


@pytest.mark.parametrize("failure", ["start", "complete"])
def test_failed_nixl_read_from_the_store_is_counted_and_recomputed(
    llama_dir: Path, kvstore: str, failure: str
) -> None:
    """A READ that cannot start, or ends in error, leaves only the local hit: the request computes the
    rest itself (tokens unchanged), the failure is counted once, and the next fetch goes over gRPC."""
    from services.common.kv.kv_transfer import KVTransferError
    from services.engine import LLM, SamplingParams
    from services.engine.kv_transfer.nixl_transfer import TransferState

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = prompts(1, seed=24)[0] + list(range(3, 70))
    kw = {
        "served_model_name": MODEL,
        "kvstore_url": kvstore,
        "block_size": 16,
        "num_kv_blocks": 64,
        "max_model_len": 512,
    }
    source = LLM(model=str(llama_dir), dtype="float32", **kw)
    expected = source.generate([prompt], params)[0].outputs[0].token_ids
    # a prompt sharing 2 blocks with it, unique to this case, stored too
    changed = prompt[:40] + [prompt[40] % 300 + (2 if failure == "start" else 3)] + prompt[41:]
    expected_changed = source.generate([changed], params)[0].outputs[0].token_ids
    _wait_stored(kvstore, changed, (len(changed) - 1) // 16)
    cold = LLM(model=str(llama_dir), dtype="float32", **kw)
    store = cold.engine.core.connector
    transfer = store.tier._transfer
    real_poll = transfer.poll

    def read_cannot_start(*_args: object, **_kw: object) -> None:
        raise KVTransferError("injected: the store's memory is unreachable")

    def read_ends_in_error(handle: object) -> TransferState:
        if real_poll(handle) is TransferState.PENDING:
            return TransferState.PENDING
        handle.state, handle.error = TransferState.ERROR, "injected"
        return TransferState.ERROR

    if failure == "start":
        transfer.read_blocks = read_cannot_start
    else:
        transfer.poll = read_ends_in_error
    out = cold.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 0
    assert store.stats().failures["transfer_error"] == 1 and store.tier.blocks_received == 0
    again = cold.generate([changed], params)[0]  # 2 blocks local, the rest from the store: over gRPC now
    assert again.outputs[0].token_ids == expected_changed
    assert again.num_cached_tokens == (len(changed) - 1) // 16 * 16 and store.tier.blocks_received > 0
    assert store.stats().failures["transfer_error"] == 1


def test_store_stopped_then_restarted_is_used_again(llama_dir: Path) -> None:
    """The store goes away under an engine that offloads to it: the engine serves on; a store started
    again on the same address gets blocks again, and another engine reads a prefix from it."""
    port = free_port()
    # Metrics off: the default metrics port (port + 1) may be taken, and this test reads none of them.
    fixed = ("--port", str(port), "--metrics-port", "0")
    a = None
    try:
        with running_kvstore(*fixed) as target:
            a = start_in_process(llama_dir, "--kvstore-url", f"grpc://{target}", *ARGS)
            first = prompts(1, seed=31)[0] + list(range(3, 60))
            complete(a, first)
            _wait_stored(target, first, (len(first) - 1) // 16)
        for prompt in prompts(4, seed=32):  # the store is gone: answered all the same
            complete(a, prompt)
        with running_kvstore(*fixed) as target:
            sent, deadline = _blocks(a, "sent", "kvstore"), time.monotonic() + 20
            for seed in range(40, 80):  # the engine skips a failed tier for 5 s, then offloads again
                again = prompts(1, seed=seed)[0] + list(range(100, 180))
                ref = complete(a, again)
                if _blocks(a, "sent", "kvstore") > sent or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            _wait_stored(target, again, (len(again) - 1) // 16)
            b = start_in_process(llama_dir, "--kvstore-url", f"grpc://{target}", *ARGS)
            try:
                out = complete(b, again)
                assert out["choices"][0]["text"] == ref["choices"][0]["text"]
                assert _blocks(b, "received", "kvstore") == (len(again) - 1) // 16
            finally:
                b.stop()
    finally:
        if a is not None:
            a.stop()
