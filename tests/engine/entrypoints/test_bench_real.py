"""``kvferry bench serve`` against a real ``kvferry serve`` (the bench tests use a fake server); metrics move."""

from __future__ import annotations

import json
from pathlib import Path

from services.cli import main
from tests.engine.entrypoints.helpers import API_KEY, MODEL, ServerProcess

COUNTERS = (
    "kvferry_prompt_tokens_total",
    "kvferry_generation_tokens_total",
    "kvferry_prefix_cache_queries_total",
    "kvferry_prefix_cache_hits_total",
    "kvferry_time_to_first_token_seconds_count",
    "kvferry_inter_token_latency_seconds_count",
    "kvferry_e2e_request_latency_seconds_count",
    "kvferry_request_queue_time_seconds_count",
)


def test_bench_completions_against_real_server(server: ServerProcess, tmp_path: Path) -> None:
    before = server.metrics()
    result = tmp_path / "result.json"
    argv = [
        "bench",
        "serve",
        "--url",
        server.url,
        "--api-key",
        API_KEY,
        "--num-prompts",
        "8",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--dataset",
        "shared-prefix",
        "--prefix-len",
        "32",
        "--num-prefixes",
        "2",
        "--vocab-size",
        "400",
        "--no-progress",
        "--result-json",
        str(result),
    ]
    assert main(argv) == 0
    summary = json.loads(result.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_input_tokens"] == 8 * 40  # prompt tokens as the server's usage counts them
    assert summary["total_output_tokens"] == 8 * 4
    after = server.metrics()
    assert after["kvferry_generation_tokens_total"] - before["kvferry_generation_tokens_total"] == 32
    assert after["kvferry_prompt_tokens_total"] - before["kvferry_prompt_tokens_total"] == 320
    assert (
        after['kvferry_request_success_total{finish_reason="length"}']
        - before.get('kvferry_request_success_total{finish_reason="length"}', 0)
        == 8
    )
    for name in COUNTERS:
        assert after[name] > before.get(name, 0), name
    info = [k for k in after if k.startswith("kvferry_cache_config_info{")]
    assert info == [
        f'kvferry_cache_config_info{{block_size="16",hash_version="1",model="{MODEL}",num_blocks="4096",'
        'quantization="none"}'
    ]


def test_bench_chat_against_real_server(server: ServerProcess, llama_dir: Path) -> None:
    argv = [
        "bench",
        "serve",
        "--url",
        f"{server.url}/v1",
        "--api-key",
        API_KEY,
        "--endpoint",
        "chat",
        "--num-prompts",
        "4",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--no-progress",
        "--tokenizer",
        str(llama_dir),
    ]
    assert main(argv) == 0
