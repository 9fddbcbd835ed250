"""A model step that raises fails only the requests in that step; the server keeps serving (in-process)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from services.common.openai.sse import iter_sse
from services.engine.async_llm import AsyncLLM
from services.engine.core.config import EngineConfig
from services.engine.entrypoints.api_server import build_app
from services.engine.entrypoints.serving import ServerSettings

POISON = 7  # a prompt containing this token id makes the model raise


class PoisonedModel:
    """Wraps the runner's model: raises when the batch contains the poison token."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected step failure")
        return self._model(input_ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def app_url(qwen2_dir: Path) -> Iterator[tuple[str, AsyncLLM]]:
    llm = AsyncLLM(EngineConfig(model=str(qwen2_dir), dtype="float32", max_model_len=256, num_kv_blocks=64))
    llm.engine.core.runner.model = PoisonedModel(llm.engine.core.runner.model)  # before any request runs
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(llm, ServerSettings()), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    yield url, llm
    server.should_exit = True
    thread.join(30)
    sock.close()


def test_failing_step_fails_its_request_only(app_url: tuple[str, AsyncLLM]) -> None:
    url, _ = app_url
    good = {"prompt": [11, 12, 13], "max_tokens": 3, "ignore_eos": True}
    bad = {"prompt": [11, POISON, 13], "max_tokens": 3}
    with httpx.Client(base_url=url, timeout=60) as http:
        failed = http.post("/v1/completions", json=bad)
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "engine_error"
        assert "injected step failure" in failed.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as stream:
            events = list(iter_sse(stream.iter_bytes()))
        assert events[-2].json()["error"]["code"] == "engine_error" and events[-1].is_done
        ok = http.post("/v1/completions", json=good)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert 'kvferry_request_success_total{finish_reason="error"} 2.0' in metrics
        assert "kvferry_num_requests_running 0.0" in metrics


def test_dead_engine_is_unhealthy(app_url: tuple[str, AsyncLLM]) -> None:
    url, llm = app_url
    llm.shutdown()
    assert httpx.get(f"{url}/health").status_code == 503
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
