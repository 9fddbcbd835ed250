"""The real operator process (`kvferry operator`, kopf) against the emulated API server on 127.0.0.1."""

from __future__ import annotations

import copy
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.sim.timing_model import TimingModel
from tests.engine.entrypoints.helpers import MODEL, free_port
from tests.operator.cluster import MONITORING_RESOURCES, POOLS, Cluster, wait_for
from tests.operator.conftest import OperatorProcess, load_example
from tests.operator.crd_validator import CrdValidator
from tests.router.stack import start_router

pytestmark = pytest.mark.timeout(120)
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"


def pool_body(
    name: str, namespace: str, example: str = "aggregated-pool.yaml", **spec: Any
) -> dict[str, Any]:
    body = copy.deepcopy(load_example(example))
    body["metadata"] = {"name": name, "namespace": namespace}
    body["spec"].update(spec)
    return body


def pool_path(namespace: str, name: str = "") -> str:
    return f"{POOLS}/namespaces/{namespace}/inferencepools" + (f"/{name}" if name else "")


def phase(cluster: Cluster, namespace: str, name: str) -> str | None:
    obj = cluster.get(pool_path(namespace, name)) or {}
    return (obj.get("status") or {}).get("phase")


def deployment(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    return cluster.get(DEPLOYMENTS.format(ns=namespace) + f"/{name}")


def test_create_renders_children_and_becomes_ready(cluster, operator_process: OperatorProcess):
    cluster.call("POST", pool_path("alpha"), pool_body("chat", "alpha"))
    created = wait_for(lambda: deployment(cluster, "alpha", "chat-router"), what="router Deployment")
    pool = cluster.get(pool_path("alpha", "chat"))
    assert created["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert "kvferry.dev/finalizer" in pool["metadata"]["finalizers"]
    wait_for(lambda: deployment(cluster, "alpha", "chat-engine"), what="engine Deployment")
    assert phase(cluster, "alpha", "chat") in ("Progressing", None)
    cluster.settle("alpha")
    wait_for(lambda: phase(cluster, "alpha", "chat") == "Ready", what="phase Ready")
    pool = cluster.get(pool_path("alpha", "chat"))
    status = pool["status"]
    assert status["endpoint"] == "http://chat-router.alpha.svc:80"
    assert status["decode"]["readyReplicas"] == 2 and status["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "ConfigConsistent": "True",
    }
    assert (
        CrdValidator().errors(
            {k: v for k, v in pool.items() if k != "metadata"} | {"metadata": {"name": "chat"}}
        )
        == []
    )
    applies = cluster.requests_to("PATCH", "/deployments/chat-engine")
    assert [r.headers["Content-Type"] for r in applies] == ["application/apply-patch+yaml"]
    assert applies[0].params["fieldManager"] == "kvferry-operator"
    assert operator_process.count("[alpha/chat] Handler 'reconcile-create' succeeded") == 1


def test_update_reapplies_only_the_changed_role(cluster, operator_process: OperatorProcess):
    body = pool_body("pd", "beta", "disaggregated-pool.yaml")
    body["spec"].pop("autoscaling")
    cluster.call("POST", pool_path("beta"), body)
    wait_for(lambda: deployment(cluster, "beta", "pd-decode"), what="decode Deployment")
    cluster.settle("beta")
    wait_for(lambda: phase(cluster, "beta", "pd") == "Ready", what="phase Ready")
    before = {
        name: len(cluster.requests_to("PATCH", f"/deployments/pd-{name}"))
        for name in ("prefill", "decode", "router", "kvstore")
    }
    old_generation = deployment(cluster, "beta", "pd-decode")["metadata"]["generation"]
    cluster.merge(pool_path("beta", "pd"), {"spec": {"decode": {"replicas": 3}}})
    wait_for(lambda: deployment(cluster, "beta", "pd-decode")["spec"]["replicas"] == 3, what="decode scaled")
    wait_for(
        lambda: operator_process.count("[beta/pd] Handler 'reconcile-update/spec' succeeded") == 1,
        what="update handler",
    )
    after = {name: len(cluster.requests_to("PATCH", f"/deployments/pd-{name}")) for name in before}
    assert after == {**before, "decode": before["decode"] + 1}
    assert deployment(cluster, "beta", "pd-decode")["metadata"]["generation"] == old_generation + 1
    wait_for(lambda: phase(cluster, "beta", "pd") == "Progressing", what="Progressing while rolling")
    cluster.settle("beta")
    wait_for(lambda: phase(cluster, "beta", "pd") == "Ready", what="Ready again")
    assert cluster.get(pool_path("beta", "pd"))["status"]["decode"]["readyReplicas"] == 3


def test_disabling_a_component_prunes_its_children(cluster, operator_process: OperatorProcess):
    cluster.merge(pool_path("beta", "pd"), {"spec": {"kvstore": {"enabled": False}}})
    wait_for(lambda: deployment(cluster, "beta", "pd-kvstore") is None, what="kvstore pruned")
    # the prune deletes one object after the other: its Service goes right after the Deployment
    wait_for(lambda: cluster.get("/api/v1/namespaces/beta/services/pd-kvstore") is None, what="its Service")
    args = deployment(cluster, "beta", "pd-decode")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kvstore-url" not in args


def test_invalid_spec_is_reported_as_degraded_not_retried(cluster, operator_process: OperatorProcess):
    body = pool_body("broken", "gamma", mode="Disaggregated")  # no spec.prefill: the CRD's CEL would refuse
    cluster.call("POST", pool_path("gamma"), body)
    wait_for(lambda: phase(cluster, "gamma", "broken") == "Degraded", what="Degraded")
    degraded = next(
        c
        for c in cluster.get(pool_path("gamma", "broken"))["status"]["conditions"]
        if c["type"] == "Degraded"
    )
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.prefill is required when mode is Disaggregated" in degraded["message"]
    assert cluster.items(DEPLOYMENTS.format(ns="gamma")) == []
    cluster.merge(pool_path("gamma", "broken"), {"spec": {"mode": "Aggregated"}})
    wait_for(lambda: deployment(cluster, "gamma", "broken-engine"), what="fixed spec reconciles")
    assert operator_process.count("[gamma/broken] Handler 'reconcile-create' succeeded") == 1
    assert operator_process.count("[gamma/broken] Handler 'reconcile-create' failed") == 0


def test_a_gateway_pool_gets_gies_inference_pool_and_loses_it_when_disabled(
    cluster, operator_process: OperatorProcess
):
    gie = "/apis/inference.networking.k8s.io/v1/namespaces/eps/inferencepools/gw"
    cluster.call("POST", pool_path("eps"), pool_body("gw", "eps", "gateway-pool.yaml"))
    applied = wait_for(lambda: cluster.get(gie), what="GIE InferencePool")
    assert applied["spec"]["endpointPickerRef"]["name"] == "gw-epp"
    assert cluster.get("/api/v1/namespaces/eps/services/gw-epp") is not None
    cluster.merge(pool_path("eps", "gw"), {"spec": {"gateway": {"enabled": False}}})
    wait_for(lambda: cluster.get(gie) is None, what="GIE InferencePool pruned")
    # one reconcile prunes both, one API call after the other: wait for the second as well
    wait_for(lambda: cluster.get("/api/v1/namespaces/eps/services/gw-epp") is None, what="EPP Service pruned")
    args = deployment(cluster, "eps", "gw-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--epp-port" not in args


def test_delete_runs_teardown_and_releases_the_finalizer(cluster, operator_process: OperatorProcess):
    cluster.call("DELETE", pool_path("alpha", "chat"))
    wait_for(lambda: cluster.get(pool_path("alpha", "chat")) is None, what="pool gone")
    assert cluster.items(DEPLOYMENTS.format(ns="alpha")) == []
    assert cluster.items("/api/v1/namespaces/alpha/configmaps") == []
    assert operator_process.count("[alpha/chat] Handler 'teardown' succeeded") == 1


class FakeEngines:
    """A /metrics endpoint standing in for every engine pod (the pods' http port points here)."""

    def __init__(self) -> None:
        self.waiting = 0.0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.page().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self.thread.start()

    def page(self) -> str:
        return (
            f"kvferry_num_requests_waiting {self.waiting}\nkvferry_num_requests_running 1\n"
            "kvferry_kv_cache_usage_ratio 0.5\n"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_engine_metrics_drive_scale_up_then_drained_scale_down(cluster, operator_process: OperatorProcess):
    engines = FakeEngines()
    try:
        body = pool_body("auto", "delta", "disaggregated-pool.yaml")
        body["spec"]["autoscaling"]["scaleDownStabilizationSeconds"] = 0
        body["spec"]["autoscaling"].pop("prefillDecodeRatio")
        cluster.call("POST", pool_path("delta"), body)
        wait_for(lambda: deployment(cluster, "delta", "auto-prefill"), what="prefill Deployment")
        assert "replicas" not in deployment(cluster, "delta", "auto-prefill")["spec"]
        engines.waiting = 8.0  # 8 waiting per replica against a target of 4 -> double
        cluster.settle("delta", http_port=engines.port)

        def prefill_replicas() -> int:
            return deployment(cluster, "delta", "auto-prefill")["spec"].get("replicas", 1)

        wait_for(lambda: prefill_replicas() == 2, what="scale-up 1 -> 2")
        managers = {
            m["manager"] for m in deployment(cluster, "delta", "auto-prefill")["metadata"]["managedFields"]
        }
        assert managers == {"kvferry-operator", "kvferry-autoscaler", "tests"}
        wait_for(
            lambda: any(
                e.get("reason") == "ScaledUp" for e in cluster.items("/api/v1/namespaces/delta/events")
            ),
            what="ScaledUp event",
        )
        assert deployment(cluster, "delta", "auto-decode")["spec"]["replicas"] == 2  # decode held at its min
        cluster.settle("delta", http_port=engines.port)
        wait_for(lambda: prefill_replicas() == 4, what="scale-up 2 -> 4 (max)")
        cluster.settle("delta", http_port=engines.port)
        engines.waiting = 0.0
        wait_for(lambda: prefill_replicas() == 1, what="scale-down to min")
        pods = cluster.items("/api/v1/namespaces/delta/pods", "kvferry.dev/role=prefill")
        draining = sorted(
            p["metadata"]["name"]
            for p in pods
            if p["metadata"].get("annotations", {}).get("kvferry.dev/draining") == "true"
        )
        assert len(draining) == 3  # marked before replicas dropped
        cluster.settle("delta", http_port=engines.port)
        left = cluster.items("/api/v1/namespaces/delta/pods", "kvferry.dev/role=prefill")
        assert [p["metadata"]["name"] for p in left if p["metadata"]["name"] not in draining] == [
            p["metadata"]["name"] for p in left
        ]
        assert operator_process.count("[delta/auto] autoscaler scaled prefill: 4 -> 1") == 1
    finally:
        engines.close()


def degraded_condition(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    conditions = ((cluster.get(pool_path(namespace, name)) or {}).get("status") or {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "Degraded"), None)


def test_monitoring_waits_for_the_prometheus_operator_then_renders_and_prunes(
    cluster, operator_process: OperatorProcess
):
    monitors = "/apis/monitoring.coreos.com/v1/namespaces/delta"
    body = pool_body("mon", "delta", monitoring={"labels": {"release": "kps"}})
    cluster.call("POST", pool_path("delta"), body)
    wait_for(
        lambda: (degraded_condition(cluster, "delta", "mon") or {}).get("reason") == "MonitoringUnavailable",
        what="Degraded: MonitoringUnavailable",
    )
    message = degraded_condition(cluster, "delta", "mon")["message"]
    assert "install the Prometheus Operator" in message and "PodMonitor" in message
    assert deployment(cluster, "delta", "mon-engine") is not None  # the pool itself is served meanwhile
    cluster.add_resources(MONITORING_RESOURCES)
    cluster.merge(pool_path("delta", "mon"), {"spec": {"monitoring": {"interval": "15s"}}})
    monitor = wait_for(lambda: cluster.get(f"{monitors}/podmonitors/mon-metrics"), what="PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert {e["interval"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"15s"}
    rule = wait_for(lambda: cluster.get(f"{monitors}/prometheusrules/mon-rules"), what="PrometheusRule")
    assert [g["name"] for g in rule["spec"]["groups"]] == ["kvferry-mon.recording", "kvferry-mon.alerts"]
    wait_for(
        lambda: (degraded_condition(cluster, "delta", "mon") or {}).get("status") == "False",
        what="Degraded False",
    )
    cluster.merge(pool_path("delta", "mon"), {"spec": {"monitoring": {"monitor": "ServiceMonitor"}}})
    wait_for(lambda: cluster.get(f"{monitors}/servicemonitors/mon-metrics"), what="ServiceMonitor")
    assert cluster.get(f"{monitors}/podmonitors/mon-metrics") is None
    cluster.merge(pool_path("delta", "mon"), {"spec": {"monitoring": None}})
    wait_for(lambda: cluster.get(f"{monitors}/servicemonitors/mon-metrics") is None, what="monitor pruned")
    wait_for(lambda: cluster.get(f"{monitors}/prometheusrules/mon-rules") is None, what="rule pruned")


def test_a_request_held_by_the_router_scales_a_role_up_from_zero(
    cluster, operator_process: OperatorProcess, llama_dir: Path, tmp_path: Path
):
    """minReplicas 0: a real router (flow control, no engine) holds a real request; the autoscaler reads the
    held demand from the router pod's /metrics and scales the engines 0 -> 1."""
    router = start_router(
        llama_dir, tmp_path, [f"http://127.0.0.1:{free_port()}"], "--flow-control", "--queue-ttl", "standard=60",
        healthy=False,
    )  # fmt: skip
    held: list[int] = []

    def ask() -> None:
        try:
            body = {"model": MODEL, "prompt": "hi"}
            held.append(httpx.post(f"{router.url}/v1/completions", json=body, timeout=90).status_code)
        except httpx.HTTPError:  # the router stopped at the end of the test, the request still held
            held.append(-1)

    worker = threading.Thread(target=ask)
    try:
        body = pool_body("zero", "echo")
        target = {"metric": "KVCacheUsage", "averageValue": 0.7}
        body["spec"]["autoscaling"] = {
            "decode": {"minReplicas": 0, "maxReplicas": 2, "target": target},
            "scaleDownStabilizationSeconds": 0,
        }
        cluster.call("POST", pool_path("echo"), body)
        wait_for(lambda: deployment(cluster, "echo", "zero-router"), what="router Deployment")
        args = deployment(cluster, "echo", "zero-router")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--flow-control" in args
        port = int(router.url.rsplit(":", 1)[1])
        cluster.settle("echo", http_port=port)  # every pod's /metrics is the real router's

        def engines() -> int:
            return deployment(cluster, "echo", "zero-engine")["spec"].get("replicas", 1)

        wait_for(lambda: engines() == 0, what="idle engines scaled to zero")
        cluster.settle("echo", http_port=port)
        worker.start()
        wait_for(lambda: router.metrics()["kvferry_router_held_requests"] == 1, what="the request is held")
        wait_for(lambda: engines() == 1, what="scale-up 0 -> 1 from the held request")
        assert operator_process.count("[echo/zero] autoscaler scaled engine: 0 -> 1") == 1
        assert not held  # still held: no engine is ready yet
    finally:
        router.stop()
        if worker.is_alive() or held:
            worker.join(10)


class DemandEngines(FakeEngines):
    """Every pod's /metrics counts ``rate`` requests/s of 500 prompt tokens and 100 output tokens."""

    def __init__(self, rate: float) -> None:
        self.rate, self.start = rate, time.monotonic()
        super().__init__()

    def page(self) -> str:
        n = self.rate * (time.monotonic() - self.start)
        return (
            "kvferry_num_requests_waiting 0\nkvferry_num_requests_running 1\n"
            f"kvferry_time_to_first_token_seconds_count {n}\nkvferry_inter_token_latency_seconds_count {99 * n}\n"
            f"kvferry_prompt_tokens_total {500 * n}\nkvferry_prefix_cache_hits_total {200 * n}\n"
        )


def test_slo_policy_scales_both_roles_from_demand_and_reads_its_timing_config_map(
    cluster, operator_process: OperatorProcess
):
    """spec.autoscaling.slo: a missing timing ConfigMap holds replicas (an event says why); once it exists,
    the observed request rate sizes decode and prefill together, in steps of maxStepReplicas."""
    engines = DemandEngines(rate=2.0)
    try:
        body = pool_body("slo", "golf", "disaggregated-pool.yaml")
        slo = {
            "ttftSeconds": 5,
            "itlSeconds": 0.4,
            "prefill": {"minReplicas": 1, "maxReplicas": 4},
            "decode": {"minReplicas": 1, "maxReplicas": 12},
            "maxStepReplicas": 3,
            "timingConfigMap": {"name": "engine-timing"},
        }
        body["spec"]["autoscaling"] = {"slo": slo, "prefillDecodeRatio": {"min": 0.25, "max": 1}}
        cluster.call("POST", pool_path("golf"), body)
        wait_for(lambda: deployment(cluster, "golf", "slo-decode"), what="decode Deployment")
        assert "replicas" not in deployment(cluster, "golf", "slo-decode")["spec"]
        cluster.settle("golf", http_port=engines.port)
        wait_for(
            lambda: any(
                e.get("reason") == "InvalidTimingModel" and "engine-timing" in e.get("message", "")
                for e in cluster.items("/api/v1/namespaces/golf/events")
            ),
            what="InvalidTimingModel event",
        )
        timing = {"timing.json": TimingModel.load().model_dump_json()}
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine-timing"}}
        cluster.call("POST", "/api/v1/namespaces/golf/configmaps", config_map | {"data": timing})

        def replicas(role: str) -> int:
            return deployment(cluster, "golf", f"slo-{role}")["spec"].get("replicas", 1)

        wait_for(lambda: replicas("decode") == 4, what="decode 1 -> 4 (one bounded step)")
        assert replicas("prefill") >= 1 and replicas("prefill") / replicas("decode") >= 0.25
        assert operator_process.count("[golf/slo] autoscaler scaled decode: 1 -> 4") == 1
    finally:
        engines.close()
