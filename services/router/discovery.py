"""KubernetesDiscovery: the pool's engines from the Kubernetes API (list, then watch, pods by label selector).

One list gives the pods and a resourceVersion; a watch from there applies every ADDED / MODIFIED /
DELETED event to the endpoint set as it comes. The watch is replaced by a fresh list and watch when it
expires (410 Gone), ends, fails, or every ``resync_s`` (a safety net). While the API server cannot be
reached the last known endpoints stay (logged once); retries back off up to ``backoff_max_s``. Which
pods are endpoints, and how they are named, is ``kube_pods``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from services.router.endpoints import EndpointSpec
from services.router.kube_pods import Pod, PodList, WatchEvent, WatchStatus, pod_endpoint

__all__ = ["DiscoverySettings", "KubernetesDiscovery", "WatchExpired", "in_cluster_url", "pod_endpoint"]

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_STEADY_S = 1.0  # a watch that lasted this long was healthy: relist at once when it ends
_BACKOFF_S = 0.25  # first wait after a failed (or short-lived) list-and-watch; doubles up to backoff_max_s


class DiscoverySettings(BaseModel):
    """Where the API server is and which pods are the pool's engines."""

    selector: str = Field(min_length=1)
    api_url: str | None = None  # default: in-cluster ($KUBERNETES_SERVICE_HOST)
    namespace: str | None = None  # default: the service account's namespace
    token_file: Path | None = None  # default: the service account token
    port: int = Field(8000, ge=1, le=65535)
    interval_s: float = Field(5.0, gt=0, description="Full relists are at least this far apart.")
    resync_s: float = Field(
        300.0, gt=0, description="Full relist period (the larger of this and interval_s)."
    )
    backoff_max_s: float = Field(10.0, gt=0, description="Longest wait between retries while the API fails.")


class WatchExpired(Exception):
    """The watch's resourceVersion is gone from the API server (410): list again."""


class KubernetesDiscovery:
    """Lists the engine pods, then watches them, handing the endpoints to ``on_change`` on every change."""

    def __init__(
        self,
        settings: DiscoverySettings,
        on_change: Callable[[Sequence[EndpointSpec]], None],
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.on_change = on_change
        self.namespace = settings.namespace or _read(SA_DIR / "namespace") or "default"
        self.api_url = (settings.api_url or in_cluster_url()).rstrip("/")
        token = _read(settings.token_file or SA_DIR / "token")
        ca = SA_DIR / "ca.crt"
        verify: Any = str(ca) if ca.is_file() else True  # in a pod: the cluster CA
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client or httpx.AsyncClient(headers=headers, verify=verify, timeout=5.0)
        self._pods: dict[str, EndpointSpec | None] = {}
        self._failing = False
        self.resource_version = ""  # where the next watch starts ("" until a list succeeded)
        self.errors = 0  # failed list or watch calls so far
        self.specs: list[EndpointSpec] = []

    @property
    def resync_s(self) -> float:
        return max(self.settings.resync_s, self.settings.interval_s)

    @property
    def pods_url(self) -> str:
        return f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods"

    async def list_once(self) -> list[EndpointSpec]:
        """One list call (its pods and resourceVersion are kept); httpx.HTTPError or ValueError on failure."""
        reply = await self._client.get(self.pods_url, params={"labelSelector": self.settings.selector})
        reply.raise_for_status()
        listing = PodList.model_validate_json(reply.content)
        self._pods = {pod.metadata.name: pod_endpoint(pod, self.settings.port) for pod in listing.items or []}
        self.resource_version = listing.metadata.resourceVersion
        return self._current()

    async def refresh(self) -> bool:
        """List and publish; on failure keep the last known set (logged once). True when it worked."""
        try:
            await self.list_once()
        except (httpx.HTTPError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            self._fail(exc)
            return False
        if self._failing:
            log.info("kubernetes discovery is back")
        self._failing = False
        self._publish()
        return True

    async def watch(self) -> None:
        """Apply the events after ``resource_version`` until the stream ends; WatchExpired on 410."""
        params = {
            "labelSelector": self.settings.selector,
            "watch": "true",
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(self.resync_s))),
        }
        timeout = httpx.Timeout(5.0, read=None)  # events may be minutes apart; resync_s bounds the stream
        async with self._client.stream("GET", self.pods_url, params=params, timeout=timeout) as reply:
            if reply.status_code == 410:
                raise WatchExpired(f"resourceVersion {self.resource_version}")
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.strip():
                    self._apply(WatchEvent.model_validate_json(line))

    def _apply(self, event: WatchEvent) -> None:
        if event.type == "ERROR":
            status = WatchStatus.model_validate(event.object)
            if status.code == 410:
                raise WatchExpired(status.message or status.reason)
            raise ValueError(f"watch error {status.code} {status.reason}: {status.message}")
        pod = Pod.model_validate(event.object)
        self.resource_version = pod.metadata.resourceVersion or self.resource_version
        if event.type == "BOOKMARK":
            return
        if event.type == "DELETED":
            self._pods.pop(pod.metadata.name, None)
        else:
            self._pods[pod.metadata.name] = pod_endpoint(pod, self.settings.port)
        self._publish()

    async def run(self) -> None:
        """List (unless ``refresh`` just did) and watch, forever; back off while rounds fail fast."""
        failures, listed = 0, bool(self.resource_version) and not self._failing
        while True:
            steady = await self._watch_round() if listed or await self.refresh() else False
            listed = False
            failures = 0 if steady else failures + 1
            if failures:
                await asyncio.sleep(min(self.settings.backoff_max_s, _BACKOFF_S * 2 ** (failures - 1)))

    async def _watch_round(self) -> bool:
        """One watch until it ends; True when it ran long enough to count as healthy (relist at once)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(self.resync_s):
                await self.watch()
            log.debug("the pod watch ended; listing again")
        except TimeoutError:
            log.debug("periodic relist after %.0f s", self.resync_s)
            return True
        except WatchExpired as exc:
            log.info("the pod watch expired (%s); listing again", exc)
        except (httpx.HTTPError, ValueError) as exc:
            self._fail(exc)
        return loop.time() - started >= _STEADY_S

    def _fail(self, exc: Exception) -> None:
        self.errors += 1
        if not self._failing:
            log.warning(
                "kubernetes discovery failed (%s); keeping the last %d endpoints",
                str(exc) or type(exc).__name__,
                len(self.specs),
            )
        self._failing = True

    def _current(self) -> list[EndpointSpec]:
        return sorted(
            (s for s in self._pods.values() if s is not None), key=lambda s: (s.url, s.role, s.draining)
        )

    def _publish(self) -> None:
        specs = self._current()
        if specs != self.specs:
            log.info(
                "discovered engines: %s",
                ", ".join(f"{s.url} ({s.role}{', draining' if s.draining else ''})" for s in specs) or "none",
            )
            self.specs = specs
            self.on_change(specs)

    async def aclose(self) -> None:
        await self._client.aclose()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def in_cluster_url() -> str:
    """The API server of the cluster this process runs in; ValueError naming the flag otherwise."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError(
            "--discovery kubernetes outside a cluster needs --kube-api URL (no $KUBERNETES_SERVICE_HOST)"
        )
    return f"https://{host}:{port}"
