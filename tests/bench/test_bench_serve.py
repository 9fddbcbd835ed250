"""``kvferry bench serve`` end to end against a real local FastAPI + uvicorn streaming server."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import openai
import pytest
from bench_fake_server import FakeBehaviour

from services.bench.serve import BenchConfig, run_bench
from services.cli import main

SMALL = ["--num-prompts", "8", "--input-len", "5", "--output-len", "4", "--no-progress"]


def test_cli_run_reports_json_table_and_plot(fake_server: str, tmp_path: Path, capsys) -> None:
    result, plot = tmp_path / "result.json", tmp_path / "latency.png"
    argv = ["bench", "serve", "--url", fake_server, *SMALL, "--result-json", str(result), "--plot", str(plot)]
    assert main(argv) == 0
    assert "Successful requests:" in capsys.readouterr().out
    data = json.loads(result.read_text())
    summary = data["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (40, 32)
    assert summary["ttft_ms"]["count"] == 8 and summary["ttft_ms"]["p50"] > 0
    assert summary["itl_ms"]["count"] == 8 * 3
    assert data["config"]["model"] == "fake-model"  # discovered through /v1/models
    assert data["config"]["request_rate"] == "Infinity"
    assert len(data["requests"]) == 8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_shared_prefix_with_rate_and_concurrency(fake_server: str) -> None:
    config = BenchConfig(
        url=fake_server + "/v1",
        model="fake-model",
        endpoint="chat",
        dataset="shared-prefix",
        num_prompts=6,
        input_len=3,
        prefix_len=4,
        num_prefixes=2,
        output_len=3,
        request_rate=500.0,
        max_concurrency=2,
        progress=False,
    )
    outcome = run_bench(config)
    assert (outcome.summary.completed, outcome.summary.failed) == (6, 0)
    assert outcome.summary.total_output_tokens == 18
    assert outcome.summary.total_input_tokens == 6 * 7  # the fake server counts words
    starts = [r.start for r in outcome.run.results]
    assert starts == sorted(starts) and starts[-1] > 0


def test_failures_are_counted_not_fatal(fake_server: str, behaviour: FakeBehaviour, capsys) -> None:
    behaviour.fail_every, behaviour.cut_every = 3, 5
    argv = ["bench", "serve", "--url", fake_server, "--max-concurrency", "1", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "HTTP 503: injected failure" in out
    assert "stream ended without data: [DONE]" in out


def test_output_tokens_fall_back_to_chunk_count(fake_server: str, behaviour: FakeBehaviour) -> None:
    behaviour.usage = False
    outcome = run_bench(
        BenchConfig(url=fake_server, num_prompts=3, input_len=2, output_len=5, progress=False)
    )
    assert outcome.summary.total_output_tokens == 15
    assert outcome.summary.total_input_tokens == 6  # dataset lengths


def test_unreachable_server_fails_every_request(capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--model", "m", *SMALL]
    assert main(argv) == 1
    assert "Failed requests:                                 8" in capsys.readouterr().out


def test_unreachable_server_without_model_exits_1(capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", *SMALL]) == 1
    assert "could not list the models" in capsys.readouterr().err


def test_api_key_is_sent_and_not_saved(fake_server: str, behaviour: FakeBehaviour, tmp_path: Path) -> None:
    behaviour.api_key = "sekrit"
    result = tmp_path / "r.json"
    argv = ["bench", "serve", "--url", fake_server, "--model", "fake-model", "--result-json", str(result)]
    assert main([*argv, *SMALL]) == 1  # no key: every request is a 401
    assert json.loads(result.read_text())["summary"]["errors"] == {"HTTP 401: Incorrect API key provided.": 8}
    assert main([*argv, *SMALL, "--api-key", "sekrit"]) == 0
    assert json.loads(result.read_text())["summary"]["completed"] == 8
    assert "sekrit" not in result.read_text()


def test_invalid_options_exit_2(capsys) -> None:
    assert main(["bench", "serve", "--dataset", "shared-prefix", "--prefix-len", "0"]) == 2
    assert "prefix-len" in capsys.readouterr().err


def test_official_openai_client_reads_the_stream(fake_server: str) -> None:
    client = openai.OpenAI(base_url=fake_server + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi there"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t0 t1 "
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="", max_tokens=1, stream=True)
    assert info.value.body["param"] == "prompt"
