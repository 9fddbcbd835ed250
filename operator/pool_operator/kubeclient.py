"""KubeClient: the few Kubernetes API calls the operator makes (server-side apply, list, patch, delete)."""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kopf

# kind -> (apiVersion, plural) of everything the operator reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "ServiceAccount": ("v1", "serviceaccounts"),
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),  # only created (the pool secret), never read, listed or patched
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "PodMonitor": ("monitoring.coreos.com/v1", "podmonitors"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitors"),
    "PrometheusRule": ("monitoring.coreos.com/v1", "prometheusrules"),
    # GIE's InferencePool (spec.gateway), not kvferry's own kind of the same name (kopf watches that one)
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
}
# Kinds whose CRDs a cluster may lack (the Prometheus Operator's, GIE's InferencePool): a 404 on listing
# them means "none".
OPTIONAL_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule", "InferencePool")
CHILD_KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    *OPTIONAL_KINDS,
)


class KubeApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}: {message}")


def resource_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """The namespaced URL path of a kind (and optionally one object and a subresource)."""
    if kind not in KINDS:
        raise ValueError(f"the operator does not manage kind {kind!r}")
    api_version, plural = KINDS[kind]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _ssl_context(info: kopf.ConnectionInfo, scratch: Path) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    ca_data = base64.b64decode(info.ca_data).decode() if info.ca_data else None
    context = ssl.create_default_context(cafile=info.ca_path, cadata=ca_data)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        cert, key = str(scratch / "client.crt"), str(scratch / "client.key")
        Path(cert).write_bytes(base64.b64decode(info.certificate_data))
        Path(key).write_bytes(base64.b64decode(info.private_key_data))
    if cert and key:
        context.load_cert_chain(cert, key)
    return context


@dataclass
class KubeClient:
    """An aiohttp session bound to one API server and its credentials."""

    server: str
    session: aiohttp.ClientSession

    @classmethod
    def from_connection(cls, info: kopf.ConnectionInfo, timeout: float = 30.0) -> KubeClient:
        """Build a client from the credentials kopf's login functions return."""
        with tempfile.TemporaryDirectory(prefix="kvferry-kube-") as scratch:
            context = _ssl_context(info, Path(scratch))
        headers = {"Accept": "application/json", "User-Agent": "kvferry-operator"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=context),
        )
        return cls(info.server.rstrip("/"), session)

    async def close(self) -> None:
        await self.session.close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self.session.request(
            method, self.server + path, params=params, data=data, headers=headers
        ) as response:
            text = await response.text()
            payload = json.loads(text) if text else {}
            if response.status >= 400:
                raise KubeApiError(
                    response.status,
                    str(payload.get("reason", response.reason)),
                    str(payload.get("message", text[:200])),
                )
            return payload

    async def apply(self, manifest: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of one object (force: the operator owns what it renders)."""
        meta = manifest["metadata"]
        path = resource_path(manifest["kind"], meta["namespace"], meta["name"])
        return await self._request(
            "PATCH",
            path,
            params={"fieldManager": field_manager, "force": "true"},
            body=manifest,
            content_type="application/apply-patch+yaml",
        )

    async def create(self, manifest: dict[str, Any], field_manager: str) -> bool:
        """Create one object; False (nothing changed) when it exists already."""
        meta = manifest["metadata"]
        try:
            await self._request(
                "POST",
                resource_path(manifest["kind"], meta["namespace"]),
                params={"fieldManager": field_manager},
                body=manifest,
            )
        except KubeApiError as error:
            if error.status == 409 and error.reason == "AlreadyExists":
                return False
            raise
        return True

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace matching a label selector."""
        answer = await self._request(
            "GET", resource_path(kind, namespace), params={"labelSelector": label_selector}
        )
        items = answer.get("items", [])
        api_version = KINDS[kind][0]
        return [
            {**item, "apiVersion": item.get("apiVersion", api_version), "kind": item.get("kind", kind)}
            for item in items
        ]

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        """One object (KubeApiError 404 when it does not exist)."""
        return await self._request("GET", resource_path(kind, namespace, name))

    async def merge_patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            resource_path(kind, namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete one object; an already missing one is fine."""
        try:
            await self._request(
                "DELETE", resource_path(kind, namespace, name), body={"propagationPolicy": "Background"}
            )
        except KubeApiError as error:
            if error.status != 404:
                raise
