"""P/D failure rules: every failure is loud (metric + log) and never leaks blocks or returns wrong tokens."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.pd.test_pd_flow import complete, pd_pair, prompts  # noqa: F401 - fixture

ARGS = ("--block-size", "16", "--num-kv-blocks", "128", "--max-model-len", "512")


def _failures(server, reason: str) -> float:
    return server.metrics().get(f'kvferry_kv_transfer_failures_total{{reason="{reason}"}}', 0)


def test_unread_lease_expires_and_frees_blocks_then_decode_recomputes(
    llama_dir: Path,
    pd_pair,  # noqa: F811
) -> None:
    _, decode, aggregated = pd_pair
    prefill = start_in_process(llama_dir, "--role", "prefill", "--kv-lease", "1", *ARGS)
    try:
        prompt = prompts(1, seed=11)[0] + list(range(3, 60))
        params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        assert params["remote_block_ids"] and prefill.metrics()["kvferry_kv_cache_usage_ratio"] > 0
        prefill.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)
        assert "lease" in prefill.log_text() and "expired" in prefill.log_text()
        assert _failures(prefill, "lease_unread") == 1
        before = _failures(decode, "lease_expired")
        out = complete(decode, prompt, params)  # too late: decode must not read freed blocks
        assert out["choices"][0]["text"] == complete(aggregated, prompt)["choices"][0]["text"]
        assert _failures(decode, "lease_expired") == before + 1
    finally:
        prefill.stop()


def test_incompatible_engines_refuse_kv_at_handshake(llama_dir: Path) -> None:
    prefill = start_in_process(llama_dir, "--role", "prefill", *ARGS)
    decode = start_in_process(
        llama_dir, "--role", "decode", "--block-size", "32", "--num-kv-blocks", "64", "--max-model-len", "512"
    )
    try:
        prompt = list(range(3, 70))
        params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
        r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_incompatible" and "block_size" in err["message"]
        assert "Traceback" not in decode.log_text()
        # the refused request freed nothing it did not own, and the engine keeps serving
        assert complete(decode, prompt)["choices"][0]["finish_reason"] == "length"
    finally:
        prefill.stop()
        decode.stop()


def test_decode_abort_releases_prefill_lease(pd_pair) -> None:  # noqa: F811
    prefill, decode, _ = pd_pair
    prompt = prompts(1, seed=12)[0] + list(range(3, 90))
    params = complete(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    with httpx.stream("POST", f"{decode.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # first token arrived: KV was read; now the client goes away
    prefill.wait_until(lambda m: m["kvferry_kv_cache_usage_ratio"] == 0.0, timeout=10)
    decode.wait_until(lambda m: m["kvferry_num_requests_running"] == 0, timeout=10)
    time.sleep(0.1)
