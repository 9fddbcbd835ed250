"""Fixtures for the operator tests: examples, the emulated cluster, the real operator process."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


@pytest.fixture
def aggregated() -> dict[str, Any]:
    return copy.deepcopy(load_example("aggregated-pool.yaml"))


@pytest.fixture
def disaggregated() -> dict[str, Any]:
    return copy.deepcopy(load_example("disaggregated-pool.yaml"))


class OperatorProcess:
    """`kvferry operator` as a subprocess pointed at the emulator; its log is kept for assertions."""

    def __init__(self, cluster: Cluster, folder: Path) -> None:
        self.log_path = folder / "operator.log"
        env = dict(
            os.environ,
            KUBECONFIG=str(cluster.kubeconfig(folder)),
            PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "operator")]),
            KVFERRY_OPERATOR_DRAIN_SECONDS="0",
            KVFERRY_OPERATOR_SCRAPE_TIMEOUT="1",
            KVFERRY_OPERATOR_RETRY_DELAY="1",
        )
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "operator",
                "--status-interval",
                "0.3",
                "--autoscale-interval",
                "0.5",
                "--metrics-port",
                "0",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def count(self, text: str) -> int:
        return self.log().count(text)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


# Every API call the operator made in this session's emulator tests (test_rbac.py):
# (method, path, query, content type).
OPERATOR_CALLS = pytest.StashKey[set[tuple[str, str, str, str]]]()


@pytest.fixture(scope="module")
def cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    emulated = Cluster().start()
    yield emulated
    calls = pytestconfig.stash.setdefault(OPERATOR_CALLS, set())
    for request in list(emulated.emulator):
        agent = request.headers.get("User-Agent", "")
        if (
            agent.startswith("kopf/") or agent == "kvferry-operator"
        ):  # the operator's calls only (kopf's, its own)
            method, url = request.method.value.upper(), request.url
            calls.add((method, url.path, url.query_string, request.headers.get("Content-Type", "")))
    emulated.stop()


@pytest.fixture(scope="module")
def operator_process(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    process = OperatorProcess(cluster, tmp_path_factory.mktemp("operator"))
    yield process
    process.stop()
    # a timer that fires while the operator stops may fail on its closed session: only before the stop
    # signal is a traceback a bug
    running = process.log().split("Signal SIGTERM is received", 1)[0]
    assert "Traceback" not in running, running[-4000:]
