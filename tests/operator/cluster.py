"""Cluster: the emulator on 127.0.0.1 in a background thread, a sync client, and a fake Deployment controller."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kmock
import yaml

from tests.operator.emulator import FaithfulKubernetes

POOLS = "/apis/kvferry.dev/v1alpha1"
RESOURCES: dict[str, dict[str, Any]] = {
    "kvferry.dev/v1alpha1/inferencepools": {
        "kind": "InferencePool",
        "namespaced": True,
        "subresources": {"status", "scale"},
        "shortnames": {"kfpool"},
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "subresources": {"status"}},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True, "subresources": {"status"}},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status", "scale"}},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {
        "kind": "PodDisruptionBudget",
        "namespaced": True,
        "subresources": {"status"},
    },
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "inference.networking.k8s.io/v1/inferencepools": {  # GIE's CRD, installed in this emulated cluster
        "kind": "InferencePool",
        "namespaced": True,
        "subresources": {"status"},
    },
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "subresources": {"status"},
    },
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
# The Prometheus Operator's kinds: served only once a test installs them (add_resources).
MONITORING_RESOURCES: dict[str, dict[str, Any]] = {
    f"monitoring.coreos.com/v1/{plural}": {"kind": kind, "namespaced": True}
    for kind, plural in (
        ("PodMonitor", "podmonitors"),
        ("ServiceMonitor", "servicemonitors"),
        ("PrometheusRule", "prometheusrules"),
    )
}


class ApiFailure(Exception):
    def __init__(self, code: int, body: dict[str, Any]) -> None:
        super().__init__(f"{code}: {body.get('message')}")
        self.code, self.body = code, body


class Cluster:
    """Owns an event loop thread running FaithfulKubernetes behind kmock's HTTP server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="emulator", daemon=True)
        self.emulator: FaithfulKubernetes | None = None
        self.server: kmock.Server | None = None

    def start(self) -> Cluster:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self.emulator = FaithfulKubernetes()
        await self.emulator.__aenter__()
        for key, info in RESOURCES.items():
            self.emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()

    def add_resources(self, resources: dict[str, dict[str, Any]]) -> None:
        """Serve more kinds from now on (as when their CRDs are installed)."""

        async def _add() -> None:
            for key, info in resources.items():
                self.emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)

        asyncio.run_coroutine_threadsafe(_add(), self.loop).result(timeout=10)

    def stop(self) -> None:
        async def _stop() -> None:
            await self.server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)

        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def kubeconfig(self, folder: Path) -> Path:
        path = folder / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
                }
            )
        )
        return path

    # -- a sync client ------------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: str = "",
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path + (f"?{params}" if params else ""),
            data=data,
            method=method,
            headers={"Content-Type": content_type, "User-Agent": "tests/1"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            raise ApiFailure(error.code, json.loads(error.read() or b"{}")) from None

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", path)
        except ApiFailure as failure:
            if failure.code == 404:
                return None
            raise

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        return self.call("GET", path, params=f"labelSelector={selector}" if selector else "")["items"]

    def merge(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.call("PATCH", path, patch, "application/merge-patch+json")

    def expire_watches(self) -> None:
        """Compact the API's history: open watches end with 410 Expired (see FaithfulKubernetes)."""
        asyncio.run_coroutine_threadsafe(self.emulator.expire_watches(), self.loop).result(timeout=10)

    def requests_to(self, method: str, path_part: str) -> list[kmock.Request]:
        """Requests the emulator received (method, and a path ending)."""
        return [
            r
            for r in list(self.emulator)
            if r.method.value.upper() == method and r.url.path.endswith(path_part)
        ]

    # -- fake controllers -----------------------------------------------------------------------
    def settle(self, namespace: str, http_port: int | None = None) -> None:
        """Act as the Deployment+ReplicaSet controllers and kubelets: pods exist and are ready."""
        for deployment in self.items(f"/apis/apps/v1/namespaces/{namespace}/deployments"):
            self._settle_one(namespace, deployment, http_port)

    def _settle_one(self, namespace: str, deployment: dict[str, Any], http_port: int | None) -> None:
        name, spec = deployment["metadata"]["name"], deployment["spec"]
        wanted = spec.get("replicas", 1)
        selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
        pods = self.items(f"/api/v1/namespaces/{namespace}/pods", selector)
        cost = "controller.kubernetes.io/pod-deletion-cost"
        pods.sort(key=lambda p: int(p["metadata"].get("annotations", {}).get(cost, "0")))
        for pod in pods[: max(0, len(pods) - wanted)]:  # lowest deletion cost goes first
            self.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}")
        names = {p["metadata"]["name"] for p in pods}
        index = 0
        for _ in range(max(0, wanted - len(pods))):
            while f"{name}-{index}" in names:
                index += 1
            names.add(f"{name}-{index}")
            self._create_pod(namespace, f"{name}-{index}", spec["template"], http_port)
        ready = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": wanted,
            "readyReplicas": wanted,
            "updatedReplicas": wanted,
            "availableReplicas": wanted,
        }
        self.merge(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/status", {"status": ready})

    def _create_pod(self, namespace: str, name: str, template: dict[str, Any], http_port: int | None) -> None:
        spec = json.loads(json.dumps(template["spec"]))
        if http_port is not None:
            for container in spec["containers"]:
                for port in container.get("ports", []):
                    if port.get("name") == "http":
                        port["containerPort"] = http_port
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": spec,
            "metadata": {
                "name": name,
                "labels": template["metadata"]["labels"],
                "annotations": template["metadata"].get("annotations", {}),
            },
        }
        self.call("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        self.merge(
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            },
        )


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2, what: str = ""
) -> Any:
    """Poll until predicate() is truthy (sleeping between polls); AssertionError on timeout (a bound on a
    hang, not a timed assertion: a loaded 2-core machine can take 20 s for a step the operator does at once)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)
