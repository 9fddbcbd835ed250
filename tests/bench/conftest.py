"""Fixtures for the load-generator tests: a fake OpenAI streaming server on a free local port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bench_fake_server import FakeBehaviour, make_app, serve_in_thread


@pytest.fixture
def behaviour() -> FakeBehaviour:
    return FakeBehaviour()


@pytest.fixture
def fake_server(behaviour: FakeBehaviour) -> Iterator[str]:
    with serve_in_thread(make_app(behaviour)) as url:
        yield url
