"""P/D with tensor parallelism: a TP=2 prefill and a TP=2 decode (gloo, one worker process each) move
every rank's KV shard over NIXL, rank r to rank r, and decode greedily to the tokens of an aggregated
TP=1 engine; a decode whose tensor_parallel_size differs from prefill's refuses the KV with a 409."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, EngineEndpoint
from tests.engine_harness import start_in_process
from tests.pd.test_pd_flow import complete, disaggregated, prompts

COMMON = ("--block-size", "16", "--num-kv-blocks", "128", "--max-model-len", "512")
TP2 = ("--tensor-parallel-size", "2")
RECEIVED = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'


@pytest.fixture(scope="module")
def tp_pd(llama_dir: Path) -> Iterator[tuple[EngineEndpoint, ...]]:
    servers = []
    try:
        for args in (("--role", "prefill", "--kv-lease", "20", *TP2), ("--role", "decode", *TP2), ()):
            servers.append(start_in_process(llama_dir, *args, *COMMON))
        yield tuple(servers)
    finally:
        for s in servers:
            s.stop()


def test_tp2_prefill_to_tp2_decode_equals_aggregated_tp1(tp_pd) -> None:
    prefill, decode, aggregated = tp_pd
    before = decode.metrics().get(RECEIVED, 0)
    moved = 0
    for i, prompt in enumerate(prompts(10, seed=21)):
        params, out = disaggregated(prefill, decode, prompt)
        assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"], f"prompt {i}"
        moved += len(params["remote_block_ids"])
        if params["remote_block_ids"]:
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= min(len(params["remote_block_ids"]) * 16, len(prompt) - 1)
    m = decode.metrics()
    assert m[RECEIVED] - before == moved > 0
    assert not any(k.startswith("kvferry_kv_transfer_failures_total") and v for k, v in m.items())
    # decode told prefill once every rank's read was done: prefill freed every lease
    prefill.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)


def test_handshake_lists_every_rank(tp_pd) -> None:
    prefill, _, _ = tp_pd
    hs = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()
    assert hs["compat"]["tensor_parallel_size"] == 2
    (rank1,) = hs["tp_ranks"]
    assert rank1["engine_id"] == f"{hs['engine_id']}.tp1" and rank1["num_blocks"] == hs["num_blocks"]


def test_a_decode_of_another_tp_size_refuses_the_kv_with_409(tp_pd, llama_dir: Path) -> None:
    prefill, _, aggregated = tp_pd
    decode = start_in_process(llama_dir, "--role", "decode", *COMMON)  # tensor_parallel_size 1
    try:
        prompt = list(range(3, 70))
        params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
        r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_incompatible" and err["type"] == "invalid_request_error"
        assert "tensor_parallel_size: local=1 remote=2" in err["message"], err["message"]
        assert "Traceback" not in decode.log_text()
        # the engine keeps serving, without the refused request's blocks
        want = complete(aggregated, prompt, max_tokens=4)["choices"][0]["text"]
        assert complete(decode, prompt, max_tokens=4)["choices"][0]["text"] == want
        decode.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)
    finally:
        decode.stop()
