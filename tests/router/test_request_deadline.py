"""The router's default request deadline: a request past --request-timeout is cut (504, or an SSE error event
for a stream), and its engine request is aborted (the engine goes back to idle)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from services.common.openai.sse import iter_sse
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.router.stack import start_router

# 1,000 tokens take the tiny model >1.2 s even on a fast, idle CPU; the router's deadline is 0.4 s
LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}


def _engine_idle(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return "kvferry_num_requests_running 0.0" in text and "kvferry_num_requests_waiting 0.0" in text


def test_the_router_cuts_a_request_at_its_deadline(llama_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "128")
    router = start_router(llama_dir, tmp_path, [engine.url], "--request-timeout", "0.4")
    try:
        started = time.monotonic()
        cut = httpx.post(f"{router.url}/v1/completions", json=LONG, timeout=30)
        assert cut.status_code == 504 and cut.json()["error"]["code"] == "request_timeout", cut.text
        assert time.monotonic() - started < 10
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**LONG, "stream": True}) as r:
            events = [e.data for e in iter_sse(r.iter_bytes())]
        assert events[-1] == "[DONE]" and "request_timeout" in events[-2]
        deadline = time.monotonic() + 20
        while not _engine_idle(engine.url):
            assert time.monotonic() < deadline, "the engine kept the cut requests"
            time.sleep(0.2)
        ok = httpx.post(f"{router.url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        router.stop()
        assert engine.stop() == 0
