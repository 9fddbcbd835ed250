"""--discovery kubernetes follows a watch: pods added, annotated draining or deleted show up at once (the
relist period is 60 s here, so only the watch explains it), a 410 makes it list again, and an API outage
keeps the last endpoints until the API is back. Against the emulator in tests/operator, on real sockets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.router.discovery import DiscoverySettings, KubernetesDiscovery
from services.router.endpoints import EndpointSpec
from tests.operator.cluster import Cluster
from tests.router.tcp_proxy import TcpProxy

POOL = "w"
SLOW_S = 60.0  # the relist period: anything seen sooner came through the watch


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster().start()
    yield c
    c.stop()


class Pods:
    """Engine pods of one namespace, written through the emulator's API (off the event loop)."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.path = f"/api/v1/namespaces/{namespace}/pods"

    async def add(self, name: str, ip: str) -> None:
        meta = {"name": name, "labels": {"kvferry.dev/pool": POOL, "kvferry.dev/role": "engine"}}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        await asyncio.to_thread(self.cluster.call, "POST", self.path, pod)
        await asyncio.to_thread(
            self.cluster.merge, f"{self.path}/{name}/status", {"status": {"phase": "Running", "podIP": ip}}
        )

    async def annotate(self, name: str, annotations: dict[str, str]) -> None:
        await asyncio.to_thread(
            self.cluster.merge, f"{self.path}/{name}", {"metadata": {"annotations": annotations}}
        )

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.cluster.call, "DELETE", f"{self.path}/{name}")

    def calls(self, watch: bool) -> int:
        """List (or watch) calls the API server received for these pods."""
        requests = self.cluster.requests_to("GET", self.path)
        return sum((r.params.get("watch") == "true") == watch for r in requests)


def discovery(url: str, namespace: str) -> KubernetesDiscovery:
    settings = DiscoverySettings(
        selector=f"kvferry.dev/pool={POOL}",
        api_url=url,
        namespace=namespace,
        interval_s=SLOW_S,
        resync_s=SLOW_S,
        backoff_max_s=0.5,
    )
    return KubernetesDiscovery(settings, lambda specs: None)


async def until(predicate: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` (far below SLOW_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)


def urls(d: KubernetesDiscovery) -> list[str]:
    return [s.url for s in d.specs]


async def running(d: KubernetesDiscovery, body: Callable[[asyncio.Task], Any]) -> None:
    """First list as the router does at start-up, then ``run`` in the background while ``body`` runs."""
    assert await d.refresh()
    task = asyncio.create_task(d.run())
    try:
        await body(task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await d.aclose()


def test_watch_applies_added_draining_and_deleted_pods_at_once(cluster: Cluster) -> None:
    pods = Pods(cluster, "watch-events")
    seen: list[list[EndpointSpec]] = []

    async def body(_: asyncio.Task) -> None:
        await pods.add("e-1", "10.1.0.2")
        await until(lambda: urls(d) == ["http://10.1.0.1:8000", "http://10.1.0.2:8000"], "the added pod")
        await pods.annotate("e-0", {"kvferry.dev/draining": "true"})
        await until(lambda: d.specs[0].draining, "the draining annotation")
        await pods.delete("e-1")
        await until(lambda: urls(d) == ["http://10.1.0.1:8000"], "the deleted pod")

    async def scenario() -> None:
        await pods.add("e-0", "10.1.0.1")
        d.on_change = seen.append
        await running(d, body)

    d = discovery(cluster.url, pods.namespace)
    asyncio.run(scenario())
    assert seen[-1] == [EndpointSpec(url="http://10.1.0.1:8000", draining=True)]
    assert pods.calls(watch=False) == 1  # the start-up list; every change after it came from the watch
    assert pods.calls(watch=True) == 1


def test_expired_watch_lists_again(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.router.discovery")
    pods = Pods(cluster, "watch-expiry")

    async def body(_: asyncio.Task) -> None:
        await pods.add("e-1", "10.2.0.2")
        await until(lambda: len(d.specs) == 2, "the added pod")  # the watch is open
        await asyncio.to_thread(cluster.expire_watches)  # 410 Gone: the watch's version was compacted
        await until(lambda: pods.calls(watch=False) == 2, "a second list")
        await pods.add("e-2", "10.2.0.3")  # seen by the watch that follows the new list
        await until(lambda: len(d.specs) == 3, "the pod added after the relist")

    async def scenario() -> None:
        await pods.add("e-0", "10.2.0.1")
        await running(d, body)

    d = discovery(cluster.url, pods.namespace)
    asyncio.run(scenario())
    assert pods.calls(watch=True) == 2
    assert "the pod watch expired (too old resource version" in caplog.text
    assert d.errors == 0


def test_api_outage_keeps_the_last_endpoints_and_recovers(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.router.discovery")
    pods = Pods(cluster, "watch-outage")

    async def body(_: asyncio.Task) -> None:
        await until(lambda: pods.calls(watch=True) == 1, "the watch")
        await proxy.cut()  # the API server is gone: the watch breaks, lists are refused
        await until(lambda: d.errors >= 3, "retries while the API is down")
        assert urls(d) == ["http://10.3.0.1:8000"]
        await pods.add("e-1", "10.3.0.2")  # a change the router cannot see yet
        await proxy.start()
        await until(lambda: urls(d) == ["http://10.3.0.1:8000", "http://10.3.0.2:8000"], "recovery")

    async def scenario() -> None:
        await proxy.start()
        await pods.add("e-0", "10.3.0.1")
        await running(d, body)
        await proxy.cut()

    proxy = TcpProxy(int(cluster.url.rsplit(":", 1)[1]))
    d = discovery(proxy.url, pods.namespace)
    asyncio.run(scenario())
    failed = [r for r in caplog.records if "kubernetes discovery failed" in r.getMessage()]
    assert len(failed) == 1 and "keeping the last 1 endpoints" in failed[0].getMessage()  # logged once
    assert "kubernetes discovery is back" in caplog.text
