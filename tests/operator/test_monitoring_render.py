"""spec.monitoring: the PodMonitor / ServiceMonitor and PrometheusRule a pool renders, and the scrape paths."""

from __future__ import annotations

import copy
import os

import kubernetes_validate
import pytest
import yaml

from pool_operator.images import ImageSet
from pool_operator.pool_rules import PoolRules
from pool_operator.poolfile import PoolFileError, parse_pool
from pool_operator.render import PoolRenderer
from tests.operator.conftest import REPO, load_example
from tests.operator.crd_validator import CrdValidator
from tests.operator.test_crd import MINORS

GOLDEN = REPO / "tests" / "operator" / "golden" / "monitored-pool.yaml"
UID = "0b7c6d2e-1111-4a5b-9c3d-000000000002"


def render(body: dict, uid: str | None = None) -> list[dict]:
    body = copy.deepcopy(body)
    if uid:
        body["metadata"]["uid"] = uid
    return PoolRenderer(parse_pool(body), ImageSet(version="0.1.0")).render()


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def with_monitoring(**monitoring: object) -> dict:
    body = load_example("monitored-pool.yaml")
    body["spec"]["monitoring"] = monitoring
    return body


def test_golden():
    text = yaml.safe_dump_all(render(load_example("monitored-pool.yaml"), UID), sort_keys=False, width=120)
    if os.environ.get("KVFERRY_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        f"render output changed; review, then KVFERRY_UPDATE_GOLDEN=1 ({GOLDEN})"
    )


def test_pod_monitor_scrapes_every_component_with_pool_and_role_labels():
    manifests = render(load_example("monitored-pool.yaml"), UID)
    (monitor,) = of_kind(manifests, "PodMonitor")
    assert not of_kind(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == UID
    selector = monitor["spec"]["selector"]
    assert selector["matchLabels"] == {"kvferry.dev/pool": "chat"}
    assert selector["matchExpressions"][0]["values"] == ["prefill", "decode", "router", "kvstore"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"], e["interval"]) for e in endpoints] == [
        ("http", "/metrics", "15s"),
        ("metrics", "/metrics", "15s"),
    ]
    # Every named port exists on the pods the selector picks (engines and router: http, kvstore: metrics).
    ports = {
        d["metadata"]["labels"]["kvferry.dev/role"]: {
            p["name"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        for d in of_kind(manifests, "Deployment")
    }
    assert all("http" in ports[r] for r in ("prefill", "decode", "router")) and "metrics" in ports["kvstore"]
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoints[0]["relabelings"]}
    assert relabel == {
        "pool": ["__meta_kubernetes_pod_label_kvferry_dev_pool"],
        "role": ["__meta_kubernetes_pod_label_kvferry_dev_role"],
    }


def test_service_monitor_uses_the_pool_services_and_adds_the_kvstore_metrics_port():
    manifests = render(with_monitoring(monitor="ServiceMonitor"))
    (monitor,) = of_kind(manifests, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "metrics"]
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    assert {p["name"]: p["port"] for p in services["chat-kvstore"]["spec"]["ports"]} == {
        "grpc": 50051,
        "metrics": 50052,
    }
    wanted = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    selected = {s["metadata"]["labels"]["kvferry.dev/role"] for s in services.values()} & wanted
    assert selected == {"prefill", "decode", "router", "kvstore"}
    for service in services.values():
        for minor in MINORS[-1:]:
            assert kubernetes_validate.validate(service, minor, strict=True)
    # Without a ServiceMonitor the kvstore Service keeps its one gRPC port.
    plain = {s["metadata"]["name"]: s for s in of_kind(render(with_monitoring()), "Service")}
    assert [p["name"] for p in plain["chat-kvstore"]["spec"]["ports"]] == ["grpc"]


def test_prometheus_rule_holds_the_pool_rules():
    manifests = render(load_example("monitored-pool.yaml"))
    (rule,) = of_kind(manifests, "PrometheusRule")
    assert rule["spec"]["groups"] == PoolRules("llm", "chat").groups()
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all('namespace="llm",pool="chat"' in e for e in exprs)
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {
        "KvferryEngineDown",
        "KvferryKVCacheNearlyFull",
        "KvferryKVTransferFallbacksRising",
        "KvferryRouterSelfCheckFailing",
        "KvferryRedisUnreachable",
        "KvferryRoutingInaccurate",
    }


def test_aggregated_pool_without_kvstore_selects_engines_and_router_only():
    body = load_example("aggregated-pool.yaml")
    body["spec"]["monitoring"] = {"prometheusRule": False}
    manifests = render(body)
    assert not of_kind(manifests, "PrometheusRule")
    (monitor,) = of_kind(manifests, "PodMonitor")
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["engine", "router"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"]


def test_network_policies_let_the_scrapers_reach_the_metrics_ports():
    manifests = render(load_example("monitored-pool.yaml"))
    policies = {p["metadata"]["name"]: p["spec"]["ingress"] for p in of_kind(manifests, "NetworkPolicy")}
    scraper = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert {"from": [scraper], "ports": [{"protocol": "TCP", "port": 8000}]} in policies["chat-engines"]
    assert {"from": [scraper], "ports": [{"protocol": "TCP", "port": 50052}]} in policies["chat-kvstore"]
    assert all(scraper not in rule["from"] for rule in policies["chat-redis"])
    unmonitored = load_example("monitored-pool.yaml")
    del unmonitored["spec"]["monitoring"]
    for policy in of_kind(render(unmonitored), "NetworkPolicy"):
        assert all(scraper not in rule.get("from", []) for rule in policy["spec"]["ingress"])
        assert all("prometheus" not in str(rule) for rule in policy["spec"]["ingress"])


def test_builtin_kinds_stay_valid_kubernetes_with_monitoring():
    for manifest in render(load_example("monitored-pool.yaml"), UID):
        if manifest["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a custom resource: its rules go through promtool (test_prometheus_rules)
        for minor in MINORS:
            assert kubernetes_validate.validate(manifest, minor, strict=True)


def test_crd_schema_and_pydantic_agree_on_the_monitoring_spec():
    validator = CrdValidator()
    assert validator.errors(load_example("monitored-pool.yaml")) == []
    cases = [
        ({"monitor": "None", "prometheusRule": False}, "renders nothing"),
        ({"monitor": "Prometheus"}, "monitor"),
        ({"interval": "fast"}, "interval"),
        ({"scrapeEvery": "1m"}, "scrapeEvery"),
    ]
    for monitoring, fragment in cases:
        body = with_monitoring(**monitoring)
        assert validator.errors(body), monitoring
        with pytest.raises(PoolFileError) as info:
            parse_pool(body)
        assert fragment in "; ".join(info.value.problems)
