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
from tests.pd.parallel_pd import COMMON, check_pd_equals_aggregated, pd_trio
from tests.pd.test_pd_flow import complete

TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def tp_pd(llama_dir: Path) -> Iterator[tuple[EngineEndpoint, ...]]:
    with pd_trio(llama_dir, TP2) as trio:
        yield trio


def test_tp2_prefill_to_tp2_decode_equals_aggregated_tp1(tp_pd) -> None:
    check_pd_equals_aggregated(tp_pd, n=10, seed=21)


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
