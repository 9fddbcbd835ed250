"""Reconciler: applies a pool's rendered children (server-side apply) and prunes the ones no longer rendered."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pool_operator import pool_secret
from pool_operator.config import FIELD_MANAGER, OperatorConfig
from pool_operator.kubeclient import CHILD_KINDS, OPTIONAL_KINDS, KubeApiError, KubeClient
from pool_operator.models import InferencePool
from pool_operator.naming import PoolNames
from pool_operator.render import PoolRenderer, manifest_key
from services.common.pool.pod_labels import APPLIED_HASH_ANNOTATION


class SpecConflictError(Exception):
    """The spec asks for something the live pool cannot become (e.g. a new block size)."""


class MissingKindError(Exception):
    """The spec asks for a kind the cluster does not serve (spec.monitoring without the Prometheus Operator,
    spec.gateway without GIE's CRDs); it is applied last, so the rest of the pool is in place."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # the Degraded condition's reason


@dataclass
class ReconcileResult:
    """What one reconcile pass changed."""

    applied: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"applied {len(self.applied)} ({', '.join(self.applied) or '-'}), "
            f"unchanged {len(self.unchanged)}, pruned {len(self.pruned)} ({', '.join(self.pruned) or '-'})"
        )


def _hash_of(obj: dict[str, Any]) -> str | None:
    return obj.get("metadata", {}).get("annotations", {}).get(APPLIED_HASH_ANNOTATION)


class Reconciler:
    """Makes the cluster hold exactly the children a pool renders, touching only what changed."""

    def __init__(self, client: KubeClient, config: OperatorConfig) -> None:
        self.client = client
        self.config = config

    async def live_children(self, names: PoolNames) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object of a managed kind that carries this pool's labels, keyed by (kind, name)."""
        live: dict[tuple[str, str], dict[str, Any]] = {}
        for kind in CHILD_KINDS:
            try:
                items = await self.client.list(kind, names.namespace, names.pool_selector_string())
            except KubeApiError as error:
                if error.status == 404 and kind in OPTIONAL_KINDS:
                    continue  # the CRD is not installed: nothing of that kind can exist
                raise
            for item in items:
                live[(kind, item["metadata"]["name"])] = item
        return live

    @staticmethod
    def check_immutable(
        manifests: list[dict[str, Any]], live: dict[tuple[str, str], dict[str, Any]], names: PoolNames
    ) -> None:
        """Refuse a block size change even where the CRD's CEL rule did not run."""
        wanted = next(m for m in manifests if manifest_key(m) == ("ConfigMap", names.config_map))
        current = live.get(("ConfigMap", names.config_map))
        if current is None:
            return
        old, new = current.get("data", {}).get("block-size"), wanted["data"]["block-size"]
        if old is not None and old != new:
            raise SpecConflictError(
                f"spec.engine.blockSize is immutable (live pool uses {old}, spec asks {new}); "
                "create a new pool instead"
            )

    async def reconcile(
        self, pool: InferencePool, logger: logging.Logger | logging.LoggerAdapter
    ) -> ReconcileResult:
        """Apply changed children in dependency order, then prune stale ones."""
        names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        if pool.spec.model.source.host_path is not None and not self.config.allow_host_path_models:
            raise SpecConflictError(
                "spec.model.source.hostPath mounts a folder of the node, which this operator does not allow "
                "(start it with --allow-host-path-models, chart value operator.allowHostPathModels): use "
                "spec.model.source.pvc"
            )
        renderer = PoolRenderer(pool, self.config.images, operator_namespace=self.config.operator_namespace)
        manifests = renderer.render()
        live = await self.live_children(names)
        self.check_immutable(manifests, live, names)
        result = ReconcileResult()
        await self._ensure_secret(renderer, result)
        for manifest in manifests:
            key = manifest_key(manifest)
            label = f"{key[0]}/{key[1]}"
            if key in live and _hash_of(live[key]) == _hash_of(manifest):
                result.unchanged.append(label)
                continue
            await self._apply(manifest)
            result.applied.append(label)
        rendered = {manifest_key(m) for m in manifests}
        for kind, name in sorted(set(live) - rendered):
            await self.client.delete(kind, names.namespace, name)
            result.pruned.append(f"{kind}/{name}")
        logger.info(f"reconciled pool {names.namespace}/{names.pool}: {result.summary()}")
        return result

    async def _ensure_secret(self, renderer: PoolRenderer, result: ReconcileResult) -> None:
        """Create the pool secret with a fresh token unless it exists: an existing token is never rotated."""
        label = f"Secret/{pool_secret.secret_name(renderer.names)}"
        created = await self.client.create(renderer.pool_secret(pool_secret.new_token()), FIELD_MANAGER)
        (result.applied if created else result.unchanged).append(label)

    async def _apply(self, manifest: dict[str, Any]) -> None:
        try:
            await self.client.apply(manifest, FIELD_MANAGER)
        except KubeApiError as error:
            if error.status == 404 and manifest["kind"] in OPTIONAL_KINDS:
                raise _missing(manifest) from error
            raise

    async def teardown(self, names: PoolNames) -> list[str]:
        """Delete every child (owner references would too; this does not wait for the garbage collector)."""
        deleted = []
        live = await self.live_children(names)
        for kind, name in sorted(live, key=lambda k: -CHILD_KINDS.index(k[0])):
            await self.client.delete(kind, names.namespace, name)
            deleted.append(f"{kind}/{name}")
        return deleted


def _missing(manifest: dict[str, Any]) -> MissingKindError:
    """What to install (or drop) when the cluster does not serve an optional kind the pool renders."""
    kind, api = manifest["kind"], manifest["apiVersion"]
    if kind == "InferencePool":
        return MissingKindError(
            f"spec.gateway needs GIE's InferencePool ({api}), which this cluster does not serve: install the "
            "Gateway API Inference Extension CRDs or drop spec.gateway",
            "GatewayUnavailable",
        )
    return MissingKindError(
        f"spec.monitoring needs {kind} ({api}), which this cluster does not serve: install the Prometheus "
        "Operator (kube-prometheus-stack) or drop spec.monitoring",
        "MonitoringUnavailable",
    )
