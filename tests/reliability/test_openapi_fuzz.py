"""Schemathesis against the engine's and the router's own /openapi.json, every operation, positive and
negative cases over real HTTP: 0 server errors, 0 undocumented answers, 0 bodies breaking their schema.
A modest number of cases by default; >= 1,000 per operation and mode in the slow run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_harness import InProcessEngine, start_in_process
from tests.reliability.openapi_fuzz import fuzz
from tests.router.stack import start_router


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[InProcessEngine]:
    server = start_in_process(llama_dir, "--num-kv-blocks", "256", "--max-model-len", "256")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def urls(
    engine: InProcessEngine, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    router = start_router(llama_dir, tmp_path_factory.mktemp("router"), [engine.url])
    try:
        yield {
            "engine": engine.url,
            "router": router.url,
            "logs": lambda: engine.log_text() + router.log_text(),
        }
    finally:
        router.stop()


def _check(urls: dict, target: str, examples: int) -> None:
    report = fuzz(urls[target], examples)
    print(f"\n{target}: {report.total} cases, {report.server_errors} server errors")
    for name, count in sorted(report.cases.items()):
        print(f"  {name}: {count}")
    assert not report.failures, "\n".join(report.failures)
    with_input = [n for n in report.cases if n.startswith("positive POST")]
    assert with_input and all(report.cases[n] >= examples for n in with_input)
    assert "Traceback" not in urls["logs"]()


@pytest.mark.parametrize("target", ["engine", "router"])
def test_fuzzing_finds_no_server_error_and_no_lie(urls: dict, target: str) -> None:
    _check(urls, target, 25)


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("target", ["engine", "router"])
def test_a_thousand_cases_per_operation(urls: dict, target: str) -> None:
    _check(urls, target, 1000)
