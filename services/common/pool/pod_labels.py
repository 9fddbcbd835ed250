"""The labels and annotations the operator puts on a pool's objects and pods, and that routers read.

Every object a pool owns carries the ``app.kubernetes.io`` set plus ``kvferry.dev/pool``; a role's
objects and pods add ``kvferry.dev/role`` (``prefill`` | ``decode`` | ``engine`` for engines, see
``services.common.pool.roles``; ``router``, ``kvstore``, ``redis`` for the others). When the autoscaler
scales a role down it annotates the chosen pods ``kvferry.dev/draining: "true"``: routers keep them
(their running requests finish) but send them nothing new.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

POOL_LABEL: Final = "kvferry.dev/pool"
ROLE_LABEL: Final = "kvferry.dev/role"

DRAINING_ANNOTATION: Final = "kvferry.dev/draining"
DRAINING_VALUE: Final = "true"
APPLIED_HASH_ANNOTATION: Final = "kvferry.dev/applied-hash"  # content hash of what the operator applied
CONFIG_HASH_ANNOTATION: Final = "kvferry.dev/config-hash"  # pod template: hash of the pool ConfigMap's data
DELETION_COST_ANNOTATION: Final = "controller.kubernetes.io/pod-deletion-cost"

APP_NAME_LABEL: Final = "app.kubernetes.io/name"
APP_INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
APP_COMPONENT_LABEL: Final = "app.kubernetes.io/component"
APP_PART_OF_LABEL: Final = "app.kubernetes.io/part-of"
APP_MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"

APP_NAME: Final = "kvferry"  # app.kubernetes.io/name and part-of of every pool object
MANAGED_BY: Final = "kvferry-operator"
OPERATOR_APP_NAME: Final = "kvferry-operator"  # app.kubernetes.io/name of the operator's own pods


def pool_labels(pool: str, role: str | None) -> dict[str, str]:
    """Labels of every object and pod of one role of ``pool`` (None: pool-wide objects, no role label)."""
    labels = {
        APP_NAME_LABEL: APP_NAME,
        APP_INSTANCE_LABEL: pool,
        APP_COMPONENT_LABEL: role or "pool",
        APP_PART_OF_LABEL: APP_NAME,
        APP_MANAGED_BY_LABEL: MANAGED_BY,
        POOL_LABEL: pool,
    }
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def role_selector(pool: str, role: str) -> dict[str, str]:
    """The (immutable) Deployment selector of one role of ``pool``."""
    return {POOL_LABEL: pool, ROLE_LABEL: role}


def pool_selector(pool: str) -> dict[str, str]:
    """Every object of ``pool`` that the operator manages."""
    return {POOL_LABEL: pool, APP_MANAGED_BY_LABEL: MANAGED_BY}


def selector_string(labels: Mapping[str, str]) -> str:
    """A label selector (``k=v,k=v``) matching ``labels``."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def is_draining(annotations: Mapping[str, str] | None) -> bool:
    """Whether a pod with these annotations is being drained for a scale-down."""
    return (annotations or {}).get(DRAINING_ANNOTATION) == DRAINING_VALUE
