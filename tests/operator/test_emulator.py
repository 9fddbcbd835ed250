"""FaithfulKubernetes behaves like the API server where kopf and the operator depend on it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.operator.cluster import ApiFailure, Cluster
from tests.operator.emulator import selector_matches

CM = "/api/v1/namespaces/e/configmaps"
DEP = "/apis/apps/v1/namespaces/e/deployments"


def apply(cluster: Cluster, path: str, body: dict, manager: str, force: bool = True) -> dict:
    params = f"fieldManager={manager}" + ("&force=true" if force else "")
    return cluster.call("PATCH", path, body, "application/apply-patch+yaml", params)


def test_identity_versions_and_conflicts(cluster):
    created = cluster.call("POST", CM, {"metadata": {"name": "a"}, "data": {"k": "1"}})
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["namespace"] == "e"
    with pytest.raises(ApiFailure) as raised:
        cluster.call("POST", CM, {"metadata": {"name": "a"}})
    assert raised.value.code == 409
    stale = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "data": {"k": "2"}}
    cluster.merge(f"{CM}/a", {"data": {"k": "3"}})
    with pytest.raises(ApiFailure) as raised:
        cluster.merge(f"{CM}/a", stale)
    assert raised.value.code == 409
    current = cluster.get(f"{CM}/a")["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "remove", "path": "/data"},
    ]
    with pytest.raises(ApiFailure) as raised:
        cluster.call("PATCH", f"{CM}/a", ops, "application/json-patch+json")
    assert raised.value.code == 422
    assert cluster.get(f"{CM}/a")["metadata"]["resourceVersion"] == current
    with pytest.raises(ApiFailure) as raised:
        cluster.call("PATCH", f"{CM}/a", {"data": {}}, "text/plain")
    assert raised.value.code == 415


def test_status_subresource_and_generation(cluster):
    apply(
        cluster,
        f"{DEP}/d",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d"},
            "spec": {"replicas": 1},
            "status": {"replicas": 9},
        },
        "op",
    )
    assert "status" not in cluster.get(f"{DEP}/d")  # status is ignored on the main resource
    cluster.merge(f"{DEP}/d/status", {"status": {"replicas": 1}, "spec": {"replicas": 5}})
    obj = cluster.get(f"{DEP}/d")
    assert (
        obj["status"] == {"replicas": 1}
        and obj["spec"]["replicas"] == 1
        and obj["metadata"]["generation"] == 1
    )
    cluster.merge(f"{DEP}/d", {"metadata": {"labels": {"x": "y"}}})
    assert cluster.get(f"{DEP}/d")["metadata"]["generation"] == 1  # metadata does not bump generation
    cluster.merge(f"{DEP}/d", {"spec": {"paused": True}})
    assert cluster.get(f"{DEP}/d")["metadata"]["generation"] == 2


def test_server_side_apply_ownership(cluster):
    path = f"{DEP}/ssa"
    base = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "ssa"}}
    apply(cluster, path, {**base, "spec": {"replicas": 2, "paused": False}}, "op")
    with pytest.raises(ApiFailure) as raised:
        apply(cluster, path, {**base, "spec": {"replicas": 5}}, "scaler", force=False)
    assert raised.value.code == 409 and "replicas" in raised.value.body["message"]
    apply(cluster, path, {**base, "spec": {"replicas": 5}}, "scaler")
    obj = apply(cluster, path, {**base, "spec": {"paused": True}}, "op")  # op no longer sends replicas
    assert obj["spec"] == {"replicas": 5, "paused": True}  # owned by scaler now: kept
    obj = apply(cluster, path, {**base, "spec": {}}, "op")
    assert obj["spec"] == {"replicas": 5}  # op's own field that it stopped sending is removed


def test_watch_from_a_resource_version_sees_only_later_events(cluster):
    listing = cluster.call("GET", CM)
    cluster.call("POST", CM, {"metadata": {"name": "later", "labels": {"w": "1"}}})
    url = (
        f"{cluster.url}{CM}?watch=true&resourceVersion={listing['metadata']['resourceVersion']}"
        "&timeoutSeconds=1&labelSelector=w%3D1"
    )
    with urllib.request.urlopen(url, timeout=10) as response:
        events = [json.loads(line) for line in response.read().splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "later")]


def test_finalizers_and_garbage_collection(cluster):
    owner = cluster.call("POST", CM, {"metadata": {"name": "owner", "finalizers": ["x/y"]}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    cluster.call("POST", CM, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    cluster.call("DELETE", f"{CM}/owner")
    assert cluster.get(f"{CM}/owner")["metadata"]["deletionTimestamp"]
    assert cluster.get(f"{CM}/child") is not None
    cluster.merge(f"{CM}/owner", {"metadata": {"finalizers": None}})
    assert cluster.get(f"{CM}/owner") is None and cluster.get(f"{CM}/child") is None


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("a=1", True),
        ("a==1,b=2", True),
        ("a!=1", False),
        ("c", False),
        ("!c", True),
        ("a in (1,3)", True),
        ("b notin (2)", False),
        ("", True),
    ],
)
def test_label_selectors(selector, matches):
    assert selector_matches(selector, {"a": "1", "b": "2"}) is matches
