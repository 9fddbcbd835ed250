"""Fixtures: one shared ``kvferry serve`` subprocess (API key on) and clients for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.entrypoints.helpers import API_KEY, ServerProcess, start_server


@pytest.fixture(scope="session")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server: API key on, no request timeout, the model's full 1024-token context."""
    proc = start_server(
        llama_dir, tmp_path_factory.mktemp("serve"), "--max-model-len", "1024", api_key=API_KEY
    )
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log_text(), proc.log_text()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.http() as c:
        yield c
