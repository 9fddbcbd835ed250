"""Fixtures of the router tests: a real redis-server per test, and per module a pool of real engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.entrypoints.helpers import ServerProcess
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from tests.router.stack import start_engines


@pytest.fixture(scope="module")
def pool_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def engines(llama_dir: Path, log_dir: Path, pool_redis: RedisServer) -> Iterator[list[ServerProcess]]:
    """Three aggregated engines publishing their KV blocks to the module's Redis."""
    servers = start_engines(llama_dir, log_dir, 3, pool_redis.url)
    yield servers
    for server in servers:
        server.stop()
