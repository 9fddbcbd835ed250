"""--discovery kubernetes: the router finds engine pods through the Kubernetes API (kmock's emulator,
made faithful in tests/operator) and honours the operator's draining annotation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.router.discovery import DiscoverySettings, KubernetesDiscovery, pod_endpoint
from services.router.endpoints import EndpointSpec
from tests.engine.entrypoints.helpers import MODEL, REPO, ServerProcess, free_port
from tests.operator.cluster import Cluster

NS, POOL = "llm", "tiny"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster().start()
    yield c
    c.stop()


def add_pod(
    cluster: Cluster,
    name: str,
    role: str,
    ip: str | None,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
) -> None:
    meta = {
        "name": name,
        "namespace": NS,
        "labels": {"kvferry.dev/pool": POOL, "kvferry.dev/role": role},
        "annotations": annotations or {},
    }
    cluster.call(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        },
    )
    status = {"phase": phase, **({"podIP": ip} if ip else {})}
    cluster.merge(f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": status})


def discover(cluster: Cluster, port: int = 8000) -> list[EndpointSpec]:
    seen: list[list[EndpointSpec]] = []
    settings = DiscoverySettings(
        selector=f"kvferry.dev/pool={POOL}", api_url=cluster.url, namespace=NS, port=port
    )

    async def once() -> list[EndpointSpec]:
        d = KubernetesDiscovery(settings, seen.append)
        await d.refresh()
        await d.aclose()
        return d.specs

    return asyncio.run(once())


def test_pods_become_endpoints_by_role_phase_ip_and_draining(cluster: Cluster) -> None:
    add_pod(cluster, "p-0", "prefill", "10.0.0.1")
    add_pod(cluster, "d-0", "decode", "10.0.0.2")
    add_pod(cluster, "d-1", "decode", "10.0.0.3", annotations={"kvferry.dev/draining": "true"})
    add_pod(cluster, "d-2", "decode", None, phase="Pending")
    add_pod(cluster, "r-0", "router", "10.0.0.9")
    assert discover(cluster) == [
        EndpointSpec(url="http://10.0.0.1:8000", role="prefill"),
        EndpointSpec(url="http://10.0.0.2:8000", role="decode"),
        EndpointSpec(url="http://10.0.0.3:8000", role="decode", draining=True),
    ]
    assert (
        pod_endpoint(
            {
                "metadata": {"labels": {"kvferry.dev/role": "engine"}, "deletionTimestamp": "now"},
                "status": {"phase": "Running", "podIP": "10.0.0.4"},
            },
            8000,
        )
        is None
    )


def test_api_server_down_keeps_the_last_endpoints(cluster: Cluster) -> None:
    settings = DiscoverySettings(selector="x=y", api_url=f"http://127.0.0.1:{free_port()}", namespace=NS)

    async def scenario() -> list[EndpointSpec]:
        d = KubernetesDiscovery(settings, lambda specs: None)
        d.specs = [EndpointSpec(url="http://10.0.0.1:8000")]
        await d.refresh()
        await d.aclose()
        return d.specs

    assert asyncio.run(scenario()) == [EndpointSpec(url="http://10.0.0.1:8000")]


def _engine(model: Path, ip: str, port: int, log_dir: Path) -> ServerProcess:
    log = log_dir / f"engine-{ip}.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        str(model),
        "--host",
        ip,
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "64",
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://{ip}:{port}", log)


def _wait(predicate, timeout: float = 90.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def test_router_discovers_engines_and_stops_sending_to_a_draining_pod(
    cluster: Cluster, llama_dir: Path, tmp_path: Path
) -> None:
    port, ns = free_port(), "pool2"
    engines = [_engine(llama_dir, ip, port, tmp_path) for ip in ("127.0.0.2", "127.0.0.3")]
    for i, e in enumerate(engines):
        meta = {
            "name": f"e-{i}",
            "namespace": ns,
            "labels": {"kvferry.dev/pool": "p2", "kvferry.dev/role": "engine"},
        }
        cluster.call(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": meta,
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        )
        cluster.merge(
            f"/api/v1/namespaces/{ns}/pods/e-{i}/status",
            {"status": {"phase": "Running", "podIP": e.url.split("//")[1].split(":")[0]}},
        )
    router_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "router",
        "--port",
        str(router_port),
        "--tokenizer",
        str(llama_dir),
        "--model-name",
        MODEL,
        "--discovery",
        "kubernetes",
        "--selector",
        "kvferry.dev/pool=p2",
        "--kube-api",
        cluster.url,
        "--kube-namespace",
        ns,
        "--engine-port",
        str(port),
        "--poll-interval",
        "0.3",
    ]
    router_log = tmp_path / "router.log"
    with router_log.open("wb") as sink:
        router = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router_port}"
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    try:
        for e in engines:
            _wait(lambda e=e: _ok(f"{e.url}/health"))
        _wait(lambda: _ok(f"{url}/health"))
        _wait(lambda: len({_post(url, body) for _ in range(6)}) == 2)  # both engines get traffic
        cluster.merge(
            f"/api/v1/namespaces/{ns}/pods/e-0",
            {"metadata": {"annotations": {"kvferry.dev/draining": "true"}}},
        )
        _wait(
            lambda: {_post(url, body) for _ in range(8)} == {engines[1].url}, timeout=10
        )  # the watch saw it
    finally:
        router.terminate()
        router.wait(15)
        for e in engines:
            e.stop()
    assert "discovered engines" in router_log.read_text()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _post(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["X-Kvferry-Endpoint"]
