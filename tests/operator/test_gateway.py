"""spec.gateway: GIE's InferencePool (valid against GIE's v1 CRD) and the endpoint picker it names."""

from __future__ import annotations

import copy
import os
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pool_operator.pool_secret import SECRET_FILE
from pool_operator.poolfile import PoolFileError, parse_pool
from pool_operator.render import PoolRenderer
from services.cli import build_parser
from tests.operator.conftest import REPO, load_example
from tests.operator.crd_validator import CrdValidator
from tests.operator.test_crd import MINORS
from tests.operator.test_render import GOLDEN, IMAGES, UID, by_name

GIE_CRD = REPO / "tests" / "operator" / "schemas" / "gie-v1-inferencepools.yaml"
GIE_API = "inference.networking.k8s.io/v1"


def pool(**gateway: Any) -> dict[str, Any]:
    body = copy.deepcopy(load_example("gateway-pool.yaml"))
    body["spec"]["gateway"].update(gateway)
    body["metadata"]["uid"] = UID
    return body


def render(body: dict[str, Any]) -> list[dict[str, Any]]:
    return PoolRenderer(parse_pool(body), IMAGES).render()


def gie_pool(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return next(m for m in manifests if m["apiVersion"] == GIE_API)


def test_golden() -> None:
    assert CrdValidator().errors(load_example("gateway-pool.yaml")) == []  # the example is a valid pool
    text = yaml.safe_dump_all(render(pool()), sort_keys=False, width=120)
    golden = GOLDEN / "gateway-pool.yaml"
    if os.environ.get("KVFERRY_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"render output changed; review, then KVFERRY_UPDATE_GOLDEN=1 ({golden})"
    )


def test_the_gie_pool_is_valid_against_gies_v1_crd_and_the_rest_is_valid_kubernetes() -> None:
    validator = CrdValidator(GIE_CRD)
    for manifest in render(pool(failureMode="FailOpen", eppPort=9100)):
        if manifest["apiVersion"] == GIE_API:
            assert validator.errors(manifest) == []
            continue
        for minor in MINORS:
            assert kubernetes_validate.validate(manifest, minor, strict=True)


def test_the_validator_would_catch_a_bad_gie_pool() -> None:
    validator = CrdValidator(GIE_CRD)
    good = gie_pool(render(pool()))
    for path, value, says in [
        (("spec", "endpointPickerRef", "failureMode"), "Sometimes", "Sometimes"),
        (("spec", "targetPorts"), [{"number": 8000}, {"number": 8000}], "port number must be unique"),
        (("spec", "extensionRef"), {"name": "x"}, "extensionRef"),  # the pre-v1 field name
    ]:
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert any(says in e for e in validator.errors(bad)), path
    no_port = copy.deepcopy(good)
    del no_port["spec"]["endpointPickerRef"]["port"]
    assert any("port is required" in e for e in validator.errors(no_port))


def test_the_gie_pool_selects_the_engines_and_names_the_routers_picker() -> None:
    manifests = render(pool(eppPort=9100, failureMode="FailOpen", fallbacks=2))
    gie = gie_pool(manifests)
    engines = by_name(manifests, "Deployment", "smollm-gw-engine")
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert gie["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert gie["spec"]["targetPorts"] == [{"number": 8000}]
    assert engines["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 8000
    ref = gie["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen"
    service = by_name(manifests, "Service", ref["name"])
    assert service["spec"]["ports"][0]["port"] == ref["port"]["number"] == 9100
    router = by_name(manifests, "Deployment", "smollm-gw-router")
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "epp", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == "epp"
    args = container["args"]
    parsed = build_parser(args).parse_args(args)
    assert (parsed.epp_port, parsed.epp_fallbacks) == (9100, 2)
    policy = by_name(manifests, "NetworkPolicy", "smollm-gw-engines")
    assert policy["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {}, "podSelector": {}}]


KEYS = {"apiKeySecretRef": {"name": "tenants", "key": "keys.txt"}}


@pytest.mark.parametrize("gateway", [False, True])
@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("failure_mode", ["FailOpen", "FailClose"])
def test_who_can_reach_the_engines_in_every_combination(gateway: bool, keys: bool, failure_mode: str) -> None:
    """Every combination of gateway, client keys and failure mode: the engines' /v1 takes the pool-internal
    key only (router and picker hold it), the operator is trusted in its own namespace only, and a gateway
    that fails open past the picker (the only key check on its path) is refused together with client keys."""
    body = pool(enabled=gateway, failureMode=failure_mode)
    if keys:
        body["spec"]["router"] = {**body["spec"].get("router", {}), **KEYS}
    refused = gateway and keys and failure_mode == "FailOpen"
    cel = CrdValidator().errors(body)
    assert any("FailOpen" in e for e in cel) == refused
    if refused:
        with pytest.raises(PoolFileError, match="FailOpen"):
            parse_pool(body)
        return
    manifests = render(body)
    engine = by_name(manifests, "Deployment", "smollm-gw-engine")["spec"]["template"]["spec"]["containers"][0]
    router = by_name(manifests, "Deployment", "smollm-gw-router")["spec"]["template"]["spec"]["containers"][0]
    serve = build_parser(engine["args"]).parse_args(engine["args"])
    route = build_parser(router["args"]).parse_args(router["args"])
    assert (
        serve.api_key_file == str(route.engine_api_key_file) == SECRET_FILE
    )  # one key: engines take, router gives
    assert serve.api_key is None
    assert (route.epp_port is not None) == gateway  # with a gateway the picker (the router) adds the key
    rules = by_name(manifests, "NetworkPolicy", "smollm-gw-engines")["spec"]["ingress"]
    http_from = rules[0]["from"]
    if gateway:  # the gateway's proxies may connect, wherever they run; the key keeps the rest out
        assert http_from == [{"namespaceSelector": {}, "podSelector": {}}]
    else:
        # no peer trusts a label in every namespace: the router's is the pool's own namespace
        assert all(p["namespaceSelector"]["matchLabels"] for p in http_from if "namespaceSelector" in p)
        operator = [p for p in http_from if "namespaceSelector" in p]
        assert operator == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvferry-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvferry-operator"}},
            }
        ]


def test_without_gateway_nothing_of_it_renders() -> None:
    body = pool()
    body["spec"]["gateway"]["enabled"] = False
    manifests = render(body)
    assert not [m for m in manifests if m["apiVersion"] == GIE_API or m["metadata"]["name"].endswith("-epp")]
    router = by_name(manifests, "Deployment", "smollm-gw-router")
    assert "--epp-port" not in router["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "Disaggregated", "prefill": {"replicas": 1}}, "gateway needs mode Aggregated"),
        (
            {"router": {"saltFromApiKey": True, "apiKeySecretRef": {"name": "k", "key": "k"}}},
            "saltFromApiKey",
        ),
        ({"gateway": {"enabled": True, "eppPort": 8000}}, "must differ from the router's HTTP port"),
    ],
)
def test_what_a_gateway_cannot_serve_is_rejected_by_cel_and_models(
    change: dict[str, Any], message: str
) -> None:
    body = pool()
    body["spec"].update(change)
    assert any(message in e for e in CrdValidator().errors(body))
    with pytest.raises(PoolFileError, match=message):
        parse_pool(body)
