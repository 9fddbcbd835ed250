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
from tests.pd.parallel_pd import COMMON, check_pd_equals_aggregated, pd_trio
from tests.pd.test_pd_flow import complete

PP2 = ("--pipeline-parallel-size", "2")


@pytest.fixture(scope="module")
def pp_pd(llama_dir: Path) -> Iterator[tuple[EngineEndpoint, ...]]:
    with pd_trio(llama_dir, PP2) as trio:
        yield trio


def test_pp2_prefill_to_pp2_decode_equals_aggregated_pp1(pp_pd) -> None:
    prefill = pp_pd[0]
    hs = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()
    assert hs["compat"]["pipeline_parallel_size"] == 2 and len(hs["tp_ranks"]) == 1  # stage 1's agent
    check_pd_equals_aggregated(pp_pd, n=6, seed=23)


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
