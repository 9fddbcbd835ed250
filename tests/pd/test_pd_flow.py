"""Disaggregated prefill/decode over NIXL between two real engines (in-process apps on real sockets).

The two-step flow is driven by a small test client (the router builds the real orchestrator):
prefill with `max_tokens=1` and `do_remote_decode`, then decode with the returned params.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.entrypoints.helpers import MODEL, EngineEndpoint
from tests.engine_harness import start_in_process

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pd_pair(llama_dir: Path) -> Iterator[tuple[EngineEndpoint, ...]]:
    common = ("--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "512")
    servers = [
        start_in_process(llama_dir, "--role", "prefill", "--kv-lease", "20", *common),
        start_in_process(llama_dir, "--role", "decode", *common),
        start_in_process(llama_dir, *common),
    ]
    yield tuple(servers)
    for s in servers:
        s.stop()


def prompts(n: int = 32, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 15, 16, 17, 32, 33, 100, 250] + [rng.randint(1, 300) for _ in range(n - 8)]
    return [[rng.randrange(3, 400) for _ in range(k)] for k in lengths]


def complete(
    server: EngineEndpoint, prompt: list[int], kv: dict | None = None, max_tokens: int = NEW_TOKENS
) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def disaggregated(prefill: EngineEndpoint, decode: EngineEndpoint, prompt: list[int]) -> tuple[dict, dict]:
    first = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)
    params = first["kv_transfer_params"]
    assert params is not None and params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"]) == len(prompt) // 16 == len(params["block_hashes"])
    return params, complete(decode, prompt, params)


def test_disaggregated_equals_aggregated_and_kv_is_transferred(pd_pair) -> None:
    prefill, decode, aggregated = pd_pair
    before = decode.metrics().get('kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}', 0)
    expected_blocks = 0
    for i, prompt in enumerate(prompts()):
        params, out = disaggregated(prefill, decode, prompt)
        ref = complete(aggregated, prompt)
        assert out["choices"][0]["text"] == ref["choices"][0]["text"], (
            f"prompt {i} (len {len(prompt)}) diverged"
        )
        n_blocks = len(params["remote_block_ids"])
        expected_blocks += n_blocks
        if n_blocks:
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= min(n_blocks * 16, len(prompt) - 1)
    m = decode.metrics()
    assert m['kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'] - before > 0
    assert not any(k.startswith("kvferry_kv_transfer_failures_total") and v for k, v in m.items())
    # decode's read notified prefill, which freed the leases: prefill's KV usage goes back to idle
    prefill.wait_until(lambda mm: mm["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)
    assert expected_blocks > 0


def test_prefill_died_decode_recomputes_correctly(llama_dir: Path, pd_pair) -> None:
    _, decode, aggregated = pd_pair
    doomed = start_in_process(
        llama_dir,
        "--role",
        "prefill",
        "--block-size",
        "16",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "512",
    )
    prompt = prompts(1, seed=9)[0] + list(range(3, 80))
    params = complete(doomed, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
    doomed.stop()
    before = _failure_counts(decode)
    out = complete(decode, prompt, params)
    assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"]
    after = _failure_counts(decode)
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert new == {
        'kvferry_kv_transfer_failures_total{reason="handshake_failed"}': 1
    }  # one failure, counted once
    assert "recomputed locally" in decode.log_text()


def _failure_counts(server) -> dict[str, float]:
    return {k: v for k, v in server.metrics().items() if k.startswith("kvferry_kv_transfer_failures_total")}


def test_short_prompt_transfers_nothing(pd_pair) -> None:
    prefill, decode, aggregated = pd_pair
    params, out = disaggregated(prefill, decode, [5, 6, 7])
    assert params["remote_block_ids"] == []
    assert out["choices"][0]["text"] == complete(aggregated, [5, 6, 7])["choices"][0]["text"]


def test_constrained_output_disaggregated_equals_aggregated(pd_pair) -> None:
    """The decode engine owns the grammar: greedy + a JSON schema over P/D equals the aggregated engine."""
    prefill, decode, aggregated = pd_pair
    schema = {
        "type": "object",
        "properties": {
            "k": {"type": "string", "enum": ["x", "y", "z"]},
            "v": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["k", "v"],
        "additionalProperties": False,
    }
    for prompt in prompts(4, seed=17):
        kv = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "guided_json": schema}
        disagg = httpx.post(
            f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=60
        )
        agg = httpx.post(f"{aggregated.url}/v1/completions", json=body, timeout=60)
        assert disagg.status_code == agg.status_code == 200, disagg.text
        text = disagg.json()["choices"][0]["text"]
        assert text == agg.json()["choices"][0]["text"]
        assert set(json.loads(text)) == {"k", "v"}


def test_speculating_decode_computes_its_draft_kv_for_ferried_prompts(llama_dir: Path, pd_pair) -> None:
    """Decode speculates with a draft model; the prompt's KV arrives over NIXL without the draft's KV, so
    decode computes the draft's KV for the prompt itself. With the target as its own draft every draft
    is accepted, which it would not be if the draft ran over a missing (zero) prompt KV."""
    prefill, _, aggregated = pd_pair
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)})
    common = ("--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "512")
    decode = start_in_process(llama_dir, "--role", "decode", "--speculative-config", spec, *common)
    try:
        for prompt in prompts(6, seed=11):
            params, out = disaggregated(prefill, decode, prompt)
            assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"]
        m = decode.metrics()
        assert m['kvferry_kv_transfer_blocks_total{direction="received",path="nixl"}'] > 0
        drafted = m["kvferry_spec_decode_num_draft_tokens_total"]
        assert drafted > 0 and m["kvferry_spec_decode_num_accepted_tokens_total"] == drafted
    finally:
        assert decode.stop() == 0


def test_sliding_window_model_disaggregated_equals_aggregated(family_dir) -> None:
    """Phi-3 with a 40-token window: prefill keeps (and leases) every block, decode reads them all and
    frees those before the window as it decodes. Then decode alone, its prefix cache holding the
    received blocks, decodes far past the window: the same text as the aggregated engine."""
    phi3 = family_dir("phi3")
    common = ("--block-size", "16", "--num-kv-blocks", "256")
    servers = [
        start_in_process(phi3, "--role", "prefill", "--kv-lease", "20", *common),
        start_in_process(phi3, "--role", "decode", *common),
        start_in_process(phi3, *common),
    ]
    prefill, decode, aggregated = servers
    try:
        for i, prompt in enumerate(prompts(10, seed=5)):
            _, out = disaggregated(prefill, decode, prompt)
            assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"], i
        for i, prompt in enumerate(prompts(10, seed=5)):
            long_ref = complete(aggregated, prompt, max_tokens=80)["choices"][0]["text"]
            assert complete(decode, prompt, max_tokens=80)["choices"][0]["text"] == long_ref, i
        failures = [
            k for k, v in decode.metrics().items() if k.startswith("kvferry_kv_transfer_failures") and v
        ]
        assert not failures
    finally:
        for s in servers:
            s.stop()
