"""Pydantic views of what discovery reads from the Kubernetes API (pods, pod lists, watch events).

Engine pods carry ``kvferry.dev/role`` (prefill | decode | engine) and, when the operator scales a role
down, the annotation ``kvferry.dev/draining: "true"``: such pods stay known (their running requests
finish) but receive nothing new. A pod is an endpoint once it is Running with an IP and not being
deleted; its URL is ``http://{podIP}:{port}``, which is also what the engine advertises in the prefix
index (``kvferry serve`` uses ``$POD_IP``), so index entries and endpoints match.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from services.common.pool.pod_labels import ROLE_LABEL, is_draining
from services.common.pool.roles import role_of_pod_label
from services.router.endpoints import EndpointSpec


class ObjectMeta(BaseModel):
    name: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None  # the field names are the API's
    resourceVersion: str = ""


class PodStatus(BaseModel):
    phase: str | None = None
    podIP: str | None = None


class Pod(BaseModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: PodStatus = Field(default_factory=PodStatus)


class ListMeta(BaseModel):
    resourceVersion: str = ""


class PodList(BaseModel):
    """The answer of a list call: the pods and the resourceVersion to watch from."""

    metadata: ListMeta = Field(default_factory=ListMeta)
    items: list[Pod] | None = None


class WatchStatus(BaseModel):
    """The object of an ERROR watch event (a metav1.Status); code 410 means the version expired."""

    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(BaseModel):
    """One line of a watch stream."""

    type: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
    object: dict[str, Any]


def pod_endpoint(pod: Pod | dict[str, Any], port: int) -> EndpointSpec | None:
    """The endpoint a pod stands for, or None (not an engine, not running, no IP, being deleted)."""
    pod = pod if isinstance(pod, Pod) else Pod.model_validate(pod)
    meta, status = pod.metadata, pod.status
    role = role_of_pod_label((meta.labels or {}).get(ROLE_LABEL))
    if role is None or meta.deletionTimestamp or status.phase != "Running" or not status.podIP:
        return None
    draining = is_draining(meta.annotations)
    return EndpointSpec(url=f"http://{status.podIP}:{port}", role=role, draining=draining)
