"""P/D with pipeline parallelism: a PP=2 prefill and a PP=2 decode (gloo, one worker process each, a layer
per stage) move every stage's part of each block over NIXL, rank r to rank r, and decode greedily to the
tokens of an aggregated PP=1 engine; a decode that splits the layers otherwise refuses the KV with a 409."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, EngineEndpoint
from tests.engine_harness import start_in_process
from tests.pd.test_pd_flow import complete, disaggregated, prompts

COMMON = ("--block-size", "16", "--num-kv-blocks", "128", "--max-model-len", "512")
PP2 = ("--pipeline-parallel-size", "2")
RECEIVED = 'kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'


@pytest.fixture(scope="module")
def pp_pd(llama_dir: Path) -> Iterator[tuple[EngineEndpoint, ...]]:
    servers = []
    try:
        for args in (("--role", "prefill", "--kv-lease", "20", *PP2), ("--role", "decode", *PP2), ()):
            servers.append(start_in_process(llama_dir, *args, *COMMON))
        yield tuple(servers)
    finally:
        for s in servers:
            s.stop()


def test_pp2_prefill_to_pp2_decode_equals_aggregated_pp1(pp_pd) -> None:
    prefill, decode, aggregated = pp_pd
    hs = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()
    assert hs["compat"]["pipeline_parallel_size"] == 2 and len(hs["tp_ranks"]) == 1  # stage 1's agent
    before = decode.metrics().get(RECEIVED, 0)
    moved = 0
    for i, prompt in enumerate(prompts(6, seed=23)):
        params, out = disaggregated(prefill, decode, prompt)
        assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"], f"prompt {i}"
        moved += len(params["remote_block_ids"])
        if params["remote_block_ids"]:
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= min(len(params["remote_block_ids"]) * 16, len(prompt) - 1)
    m = decode.metrics()
    assert m[RECEIVED] - before == moved > 0
    assert not any(k.startswith("kvferry_kv_transfer_failures_total") and v for k, v in m.items())
    prefill.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)


def test_a_decode_with_other_stages_refuses_the_kv_with_409(pp_pd, llama_dir: Path) -> None:
    prefill, _, aggregated = pp_pd
    decode = start_in_process(llama_dir, "--role", "decode", *COMMON)  # one stage: every layer
    try:
        prompt = list(range(3, 70))
        params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
        r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_incompatible"
        assert "pipeline_parallel_size: local=1 remote=2" in err["message"], err["message"]
        want = complete(aggregated, prompt, max_tokens=4)["choices"][0]["text"]
        assert complete(decode, prompt, max_tokens=4)["choices"][0]["text"] == want
    finally:
        decode.stop()
