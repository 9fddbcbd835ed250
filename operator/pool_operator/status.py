"""StatusBuilder: an InferencePool's status (roles, conditions, phase) from its children's status."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from pool_operator.models import Condition, InferencePool, PoolStatus, RoleStatus
from pool_operator.naming import PoolNames
from pool_operator.render import PoolRenderer, content_hash
from services.common.pool.pod_labels import CONFIG_HASH_ANNOTATION

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ConfigConsistent")


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """Replace condition `kind`; lastTransitionTime changes only when the status flips."""
    value = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == kind), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else now
    condition = Condition(
        type=kind,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    ).model_dump(by_alias=True, exclude_none=True)
    others = [c for c in conditions if c.get("type") != kind]
    return sorted(
        [*others, condition],
        key=lambda c: (
            CONDITION_TYPES.index(c["type"]) if c["type"] in CONDITION_TYPES else len(CONDITION_TYPES)
        ),
    )


def condition_is(conditions: list[dict[str, Any]], kind: str, value: str = "True") -> bool:
    return any(c.get("type") == kind and c.get("status") == value for c in conditions)


def _rolled_out(deployment: Mapping[str, Any]) -> bool:
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    desired = spec.get("replicas", 1)
    generation = deployment.get("metadata", {}).get("generation")
    return (
        status.get("observedGeneration", 0) >= (generation or 0)
        and status.get("updatedReplicas", 0) >= desired
        and status.get("replicas", 0) == desired
    )


class StatusBuilder:
    """Computes the status of one pool from its live Deployments and its previous status."""

    def __init__(self, pool: InferencePool, previous: Mapping[str, Any] | None = None) -> None:
        self.pool = pool
        self.renderer = PoolRenderer(pool)
        self.names = PoolNames(pool.metadata.name, pool.metadata.namespace)
        self.previous = dict(previous or {})

    def roles(self) -> dict[str, str]:
        """status key -> Deployment role of every workload the pool runs."""
        roles = (
            {"prefill": "prefill", "decode": "decode"} if self.pool.disaggregated else {"decode": "engine"}
        )
        roles["router"] = "router"
        if self.pool.spec.kvstore.enabled:
            roles["kvstore"] = "kvstore"
        return roles

    def role_status(self, key: str, role: str, deployment: Mapping[str, Any] | None) -> dict[str, Any]:
        previous = self.previous.get(key) or {}
        spec, status = (deployment or {}).get("spec", {}), (deployment or {}).get("status", {})
        return RoleStatus(
            replicas=status.get("replicas", 0),
            ready_replicas=status.get("readyReplicas", 0),
            desired_replicas=spec.get("replicas", 1) if deployment else 0,
            selector=self.names.selector_string(role),
            last_scale_time=previous.get("lastScaleTime"),
        ).model_dump(by_alias=True, exclude_none=True)

    def build(self, deployments: Mapping[str, Mapping[str, Any]], now: str | None = None) -> dict[str, Any]:
        """The full status: deployments maps Deployment name -> live object."""
        now = now or utc_now()
        generation = self.pool.metadata.generation
        out: dict[str, Any] = {
            "observedGeneration": self.previous.get("observedGeneration", generation),
            "endpoint": self.renderer.endpoint(),
        }
        missing, unready, rolling, stale = [], [], [], []
        config_hash = content_hash(self.renderer.config_data())
        for key, role in self.roles().items():
            deployment = deployments.get(self.names.child(role))
            out[key] = self.role_status(key, role, deployment)
            if deployment is None:
                missing.append(role)
                continue
            ready, desired = out[key]["readyReplicas"], out[key]["desiredReplicas"]
            if ready < desired or (role == "router" and ready == 0):
                unready.append(f"{role} {ready}/{desired}")
            if not _rolled_out(deployment):
                rolling.append(role)
            template = deployment.get("spec", {}).get("template", {}).get("metadata", {})
            if template.get("annotations", {}).get(CONFIG_HASH_ANNOTATION) != config_hash:
                stale.append(role)
        conditions = list(self.previous.get("conditions", []))
        if not any(c.get("type") == "Degraded" for c in conditions):
            # Degraded belongs to the reconcile handler; this refresh may have read the pool before
            # reconcile's first status patch landed, and must not drop the condition when it patches.
            conditions = set_condition(conditions, "Degraded", False, "NoProblemSeen", "", generation, now)
        not_ready = [f"{r} missing" for r in missing] + unready
        conditions = set_condition(
            conditions,
            "Ready",
            not not_ready,
            "AllRolesReady" if not not_ready else "RolesNotReady",
            "; ".join(not_ready),
            generation,
            now,
        )
        busy = missing + rolling
        conditions = set_condition(
            conditions,
            "Progressing",
            bool(busy),
            "RollingOut" if busy else "RolledOut",
            ", ".join(busy),
            generation,
            now,
        )
        inconsistent = sorted(set(stale + [r for r in rolling if r != "kvstore"]))
        conditions = set_condition(
            conditions,
            "ConfigConsistent",
            not inconsistent,
            "ConfigMismatch" if inconsistent else "AllPodsShareConfig",
            "pods may run mixed pool config: " + ", ".join(inconsistent) if inconsistent else "",
            generation,
            now,
        )
        out["conditions"] = conditions
        out["phase"] = self.phase(conditions, bool(deployments))
        return PoolStatus.model_validate(out).model_dump(by_alias=True, exclude_none=True)

    @staticmethod
    def phase(conditions: list[dict[str, Any]], has_children: bool) -> str:
        if condition_is(conditions, "Degraded"):
            return "Degraded"
        if condition_is(conditions, "Ready"):
            return "Ready"
        return "Progressing" if has_children else "Pending"
