"""A real Prometheus (Debian's binary) on 127.0.0.1 scraping a file_sd file, with a rule file, and its HTTP API."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.engine.entrypoints.helpers import free_port


class PrometheusServer:
    """``prometheus`` with a 1 s scrape and evaluation interval (so a short test has many samples)."""

    def __init__(self, workdir: Path, targets: Path, rules: dict[str, Any]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("prometheus is not installed: run `make setup` (Debian package prometheus)")
        self.workdir = workdir
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "kvferry",
                    "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.console.templates=/dev/null",
                    "--web.console.libraries=/dev/null",
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        self.wait(lambda: self._get("/-/ready").status_code == 200, "Prometheus ready")

    def _get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, params=params, timeout=10)

    def wait(self, ok: Any, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if ok():
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; log: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def api(self, path: str, **params: Any) -> Any:
        body = self._get(f"/api/v1/{path}", **params).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``[]``: no data)."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
