"""Per-request timeout, SIGTERM drain and the ``--role`` flag, each on its own ``kvferry serve``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.openai.sse import iter_sse
from tests.engine.entrypoints.helpers import REPO, ServerProcess, start_server

ERRORED = 'kvferry_request_success_total{finish_reason="error"}'
LONG = {"prompt": "tick tock", "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def impatient(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that gives every request 0.5 s (a 1000-token request takes seconds here)."""
    proc = start_server(llama_dir, tmp_path_factory.mktemp("impatient"), "--request-timeout", "0.5")
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log_text()


def test_timeout_fails_and_frees_the_request(impatient: ServerProcess) -> None:
    before = impatient.metrics().get(ERRORED, 0)
    with impatient.http() as http:
        response = http.post("/v1/completions", json=LONG)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG},
        ) as stream:
            events = list(iter_sse(stream.iter_bytes()))
        assert events[-1].is_done
        assert events[-2].json()["error"]["code"] == "request_timeout"
        after = impatient.wait_until(lambda m: m["kvferry_num_requests_running"] == 0, timeout=10)
        assert after[ERRORED] - before == 2
        assert http.post("/v1/completions", json={"prompt": "quick", "max_tokens": 2}).status_code == 200


def _stream(url: str, body: dict, into: list, first: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for event in iter_sse(r.iter_bytes()):
                into.append(event)
                first.set()
    finally:
        first.set()


def test_sigterm_drains_then_exits_zero(llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(llama_dir, tmp_path, "--drain-timeout", "2")
    short, long_ = [], []
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(
            target=_stream,
            args=(server.url, {"prompt": "s", "max_tokens": 40, "ignore_eos": True}, short, started[0]),
        ),
        threading.Thread(target=_stream, args=(server.url, {**LONG, "n": 16}, long_, started[1])),
    ]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(30)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert not short[-1].is_done  # still running when the drain began
    time.sleep(0.3)
    with pytest.raises(httpx.TransportError):  # no longer accepting connections
        httpx.get(f"{server.url}/health", timeout=2)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 15
    for t in threads:
        t.join(10)
    assert short[-1].is_done and short[-2].json()["choices"][0]["finish_reason"] == "length"  # drained
    assert long_[-1].is_done  # failed at --drain-timeout with an error event, not a cut stream
    assert long_[-2].json()["error"]["code"] == "service_unavailable"
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("role", ["sideways", "Prefill"])
def test_unknown_role_is_a_cli_error(role: str) -> None:
    cmd = [sys.executable, "-m", "services.cli", "serve", "--role", role]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--role" in done.stderr and role in done.stderr
