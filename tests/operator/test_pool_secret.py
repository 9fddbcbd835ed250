"""The pool secret: rendered mounts and flags, the Secret the reconciler creates once (never rotated, owned
by the pool, garbage collected with it), and NetworkPolicies that keep side-channel ports to the pool."""

from __future__ import annotations

import base64
import copy

import kubernetes_validate
import pytest

from pool_operator.naming import HTTP_PORT, KVSTORE_METRICS_PORT
from pool_operator.pool_secret import MOUNT_DIR, SECRET_FILE
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from services.cli import build_parser
from services.common.pool.pod_labels import APPLIED_HASH_ANNOTATION
from tests.operator.cluster import Cluster, wait_for
from tests.operator.conftest import OperatorProcess, load_example
from tests.operator.test_crd import MINORS
from tests.operator.test_operator import deployment, pool_body, pool_path
from tests.operator.test_render import IMAGES, UID, render

SECRETS = "/api/v1/namespaces/{ns}/secrets"


def _pod(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]


@pytest.mark.parametrize("example", ["disaggregated-pool.yaml", "aggregated-pool.yaml"])
def test_engines_and_the_kvstore_mount_the_secret_and_get_the_flag(example: str) -> None:
    manifests = render(example, UID)
    secret_users = set()
    for manifest in (m for m in manifests if m["kind"] == "Deployment"):
        pod, name = _pod(manifest), manifest["metadata"]["name"]
        container = pod["containers"][0]
        mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == MOUNT_DIR]
        volumes = [
            v for v in pod["volumes"] if "secret" in v and v["secret"]["secretName"].endswith("-pool-secret")
        ]
        args = container.get("args", [])
        if args and args[0] == "router":  # the engines' pool-internal key: the router presents it on /v1
            assert str(build_parser(args).parse_args(args).engine_api_key_file) == SECRET_FILE
            assert mounts and volumes, name
            continue
        if "--pool-secret-file" not in args:
            assert mounts == [] and volumes == [], name  # Redis calls no side channel
            continue
        secret_users.add(args[0])
        if args[0] == "serve":  # /v1 takes the pool-internal key only (router, picker)
            assert build_parser(args).parse_args(args).api_key_file == SECRET_FILE
        assert mounts == [{"name": "pool-secret", "mountPath": MOUNT_DIR, "readOnly": True}], name
        assert volumes[0]["secret"]["items"] == [{"key": "token", "path": "token"}]
        assert volumes[0]["secret"]["defaultMode"] == 0o440  # readable by the pod's fsGroup, writable by none
        assert build_parser(args).parse_args(args).pool_secret_file == SECRET_FILE  # the real CLI takes it
    kvstore = load_example(example).get("spec", {}).get("kvstore", {}).get("enabled", False)
    assert secret_users == ({"serve", "kvstore"} if kvstore else {"serve"})


def test_the_secret_manifest_is_valid_owned_and_carries_no_hash() -> None:
    body = load_example("disaggregated-pool.yaml")
    body["metadata"]["uid"] = UID
    secret = PoolRenderer(parse_pool(body), IMAGES).pool_secret("t" * 43)
    for minor in MINORS:
        assert kubernetes_validate.validate(secret, minor, strict=True)
    assert secret["metadata"]["name"] == "llama-pd-pool-secret" and secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert APPLIED_HASH_ANNOTATION not in secret["metadata"].get("annotations", {})
    assert base64.b64decode(secret["data"]["token"]) == b"t" * 43
    assert all(m["kind"] != "Secret" for m in render("disaggregated-pool.yaml", UID))  # render() stays pure


def test_side_channel_ports_are_open_to_the_pools_own_pods_only() -> None:
    """Engines: other ports (NIXL) only from the pool's engines; the HTTP port, where /kv/ needs the secret,
    also from the router, the operator and scrapers. The kvstore: gRPC and NIXL only from the pool's
    engines, the metrics port from scrapers."""
    manifests = render("monitored-pool.yaml", UID)
    pool = manifests[0]["metadata"]["labels"]["kvferry.dev/pool"]
    for policy in (m for m in manifests if m["kind"] == "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule.get("ports", [])}
            for peer in rule["from"]:
                in_pool = peer.get("podSelector", {}).get("matchLabels", {}).get("kvferry.dev/pool") == pool
                assert (
                    in_pool
                    and "namespaceSelector" not in peer
                    or ports
                    and ports
                    <= {
                        HTTP_PORT,
                        KVSTORE_METRICS_PORT,
                    }
                ), (policy["metadata"]["name"], rule)


def _token(cluster: Cluster, namespace: str, name: str) -> str | None:
    secret = cluster.get(SECRETS.format(ns=namespace) + f"/{name}")
    return None if secret is None else base64.b64decode(secret["data"]["token"]).decode()


def test_the_operator_creates_the_secret_once_and_never_rotates_it(
    cluster: Cluster, operator_process: OperatorProcess
) -> None:
    body = pool_body("sec", "delta", "disaggregated-pool.yaml")
    body["spec"].pop("autoscaling")
    cluster.call("POST", pool_path("delta"), copy.deepcopy(body))
    token = wait_for(lambda: _token(cluster, "delta", "sec-pool-secret"), what="pool Secret")
    assert len(token) >= 32
    secret = cluster.get(SECRETS.format(ns="delta") + "/sec-pool-secret")
    pool = cluster.get(pool_path("delta", "sec"))
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    decode = wait_for(lambda: deployment(cluster, "delta", "sec-decode"), what="decode Deployment")
    args = _pod(decode)["containers"][0]["args"]
    assert args[args.index("--pool-secret-file") + 1] == SECRET_FILE
    cluster.merge(pool_path("delta", "sec"), {"spec": {"decode": {"replicas": 3}}})  # a second reconcile
    wait_for(
        lambda: operator_process.count("[delta/sec] Handler 'reconcile-update/spec' succeeded") == 1,
        what="update handler",
    )
    assert _token(cluster, "delta", "sec-pool-secret") == token  # kept, not rotated
    creates = cluster.requests_to("POST", "/namespaces/delta/secrets")
    assert len(creates) == 2  # one per reconcile: the second was answered 409 AlreadyExists
    touched = {r.method.value.upper() for r in cluster.emulator if "/secrets" in r.url.path}  # never read
    assert touched <= {"POST", "GET"} and all(
        r.headers.get("User-Agent") == "tests/1"
        for r in cluster.emulator
        if "/secrets" in r.url.path and r.method.value.upper() == "GET"
    )
    cluster.call("DELETE", pool_path("delta", "sec"))
    wait_for(lambda: cluster.get(pool_path("delta", "sec")) is None, what="pool gone")
    wait_for(lambda: _token(cluster, "delta", "sec-pool-secret") is None, what="Secret garbage-collected")
