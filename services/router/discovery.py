"""KubernetesDiscovery: the pool's engines from the Kubernetes API (pods by label selector), kept current.

Engine pods carry ``kvferry.dev/role`` (prefill | decode | engine) and, when the operator scales a role
down, the annotation ``kvferry.dev/draining: "true"``: such pods stay known (their running requests
finish) but receive nothing new. A pod is an endpoint once it is Running with an IP and not being
deleted; its URL is ``http://{podIP}:{port}``, which is also what the engine advertises in the prefix
index (``kvferry serve`` uses ``$POD_IP``), so index entries and endpoints match.
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

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ROLE_LABEL = "kvferry.dev/role"
DRAINING_ANNOTATION = "kvferry.dev/draining"
_ROLES = {"prefill": "prefill", "decode": "decode", "engine": "both"}


class DiscoverySettings(BaseModel):
    """Where the API server is and which pods are the pool's engines."""

    selector: str = Field(min_length=1)
    api_url: str | None = None  # default: in-cluster ($KUBERNETES_SERVICE_HOST)
    namespace: str | None = None  # default: the service account's namespace
    token_file: Path | None = None  # default: the service account token
    port: int = Field(8000, ge=1, le=65535)
    interval_s: float = Field(5.0, gt=0)


def pod_endpoint(pod: dict[str, Any], port: int) -> EndpointSpec | None:
    """The endpoint a pod stands for, or None (not an engine, not running, no IP, being deleted)."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    role = _ROLES.get((meta.get("labels") or {}).get(ROLE_LABEL, ""))
    if role is None or meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return None
    draining = (meta.get("annotations") or {}).get(DRAINING_ANNOTATION) == "true"
    return EndpointSpec(url=f"http://{status['podIP']}:{port}", role=role, draining=draining)


class KubernetesDiscovery:
    """Lists the engine pods every ``interval_s`` and hands the endpoints to ``on_change``."""

    def __init__(self, settings: DiscoverySettings, on_change: Callable[[Sequence[EndpointSpec]], None],
                 client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.on_change = on_change
        self.namespace = settings.namespace or _read(SA_DIR / "namespace") or "default"
        self.api_url = (settings.api_url or in_cluster_url()).rstrip("/")
        token = _read(settings.token_file or SA_DIR / "token")
        ca = SA_DIR / "ca.crt"
        verify: Any = str(ca) if ca.is_file() else True  # in a pod: the cluster CA
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client or httpx.AsyncClient(headers=headers, verify=verify, timeout=5.0)
        self._failing = False
        self.specs: list[EndpointSpec] = []

    async def list_once(self) -> list[EndpointSpec]:
        """One list call; raises httpx.HTTPError when the API server cannot answer."""
        url = f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods"
        reply = await self._client.get(url, params={"labelSelector": self.settings.selector})
        reply.raise_for_status()
        specs = [s for pod in reply.json().get("items", []) if (s := pod_endpoint(pod, self.settings.port))]
        return sorted(specs, key=lambda s: s.url)

    async def refresh(self) -> None:
        """Update the endpoints; on failure keep the last known set and log once."""
        try:
            specs = await self.list_once()
        except (httpx.HTTPError, ValueError) as exc:
            if not self._failing:
                log.warning("kubernetes discovery failed (%s); keeping the last %d endpoints", exc, len(self.specs))
            self._failing = True
            return
        if self._failing:
            log.info("kubernetes discovery is back")
        self._failing = False
        if specs != self.specs:
            log.info("discovered engines: %s", ", ".join(f"{s.url} ({s.role}{', draining' if s.draining else ''})"
                                                          for s in specs) or "none")
            self.specs = specs
            self.on_change(specs)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.interval_s)

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
        raise ValueError("--discovery kubernetes outside a cluster needs --kube-api URL (no $KUBERNETES_SERVICE_HOST)")
    return f"https://{host}:{port}"
