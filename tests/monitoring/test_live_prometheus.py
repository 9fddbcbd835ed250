"""A real Prometheus scrapes a running ``kvferry up`` (P/D engines, kvstore, router) with the pool's rules
loaded; after traffic from the openai client every dashboard panel query and every recording rule returns
data through Prometheus' HTTP API, and every alert evaluates without error.

``KVFERRY_DASHBOARD_PNG=docs/images/kvferry-dashboard.png`` also renders the pool overview dashboard from
the panels' real query results (matplotlib) and sends traffic for longer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from pool_operator.pool_rules import PoolRules
from services.scrape_targets import LOCAL_NAMESPACE, LOCAL_POOL
from tests.monitoring.live_stack import kvferry_up
from tests.monitoring.prometheus_server import PrometheusServer
from tests.monitoring.queries import metric_names, panel_queries, rule_queries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SEL = f'namespace="{LOCAL_NAMESPACE}",pool="{LOCAL_POOL}"'
SYSTEM = "You are the ferry's helpful purser. " * 12  # long enough to be split off to prefill (> 256 tokens)


def send_traffic(url: str, model: str, rounds: int, pause_s: float = 0.0) -> int:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    sent = 0
    for i in range(rounds):
        system = SYSTEM if i % 3 else f"Passenger {i}: " + SYSTEM  # some prefixes shared, some not
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        chunks = list(stream)  # read to the end (stopping early would abort the request)
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        sent += 1
        time.sleep(pause_s * (i % 4))  # uneven load, for the picture
    return sent


def test_every_panel_and_rule_returns_data(llama_dir: Path, tmp_path: Path) -> None:
    png = os.environ.get("KVFERRY_DASHBOARD_PNG")
    with kvferry_up(
        llama_dir, tmp_path, "--prefill", "1", "--decode", "1", "--serve-args", "--num-kv-blocks 128"
    ) as stack:
        prom = PrometheusServer(tmp_path, stack.targets, PoolRules(LOCAL_NAMESPACE, LOCAL_POOL).rule_file())
        try:
            prom.wait(
                lambda: len(prom.targets()) == 4 and all(t["health"] == "up" for t in prom.targets()),
                "4 targets up",
            )
            start = time.time()
            sent = (
                send_traffic(stack.url, stack.name, 80, 0.5)
                if png
                else send_traffic(stack.url, stack.name, 8)
            )
            routed = f'sum(kvferry_router_requests_total{{{SEL},decision!="no_endpoint"}})'
            prom.wait(
                lambda: (r := prom.query(routed)) and float(r[0]["value"][1]) >= sent, "traffic scraped"
            )
            end = time.time()
            disaggregated = f'kvferry_router_requests_total{{{SEL},decision="disaggregated"}}'
            prom.wait(lambda: float(prom.query(disaggregated)[0]["value"][1]) > 0, "a P/D request")
            ferried = f'sum(kvferry_kv_transfer_blocks_total{{{SEL},direction="received",path="nixl"}})'
            prom.wait(lambda: float(prom.query(ferried)[0]["value"][1]) > 0, "KV blocks ferried over NIXL")
            check_every_query_has_data(prom)
            if png:
                from tests.monitoring.dashboard_png import render_dashboard

                render_dashboard(prom, "kvferry-pool.json", start, end, Path(png))
        finally:
            prom.stop()


def check_every_query_has_data(prom: PrometheusServer) -> None:
    empty = []
    for shipped in panel_queries(LOCAL_NAMESPACE, LOCAL_POOL):
        if not wait_for_data(prom, shipped.expr):
            empty.append(shipped.source)
    rules = PoolRules(LOCAL_NAMESPACE, LOCAL_POOL)
    for rule in rules.recording():
        if not wait_for_data(prom, rule["record"] + "{" + SEL + "}"):
            empty.append(rule["record"])
    for shipped in rule_queries(LOCAL_NAMESPACE, LOCAL_POOL):  # alerts: each selected series exists
        for name in metric_names(shipped.expr):
            if not prom.query(f"{name}{{{SEL}}}"):
                empty.append(f"{shipped.source}: {name}")
    assert empty == [], f"no data for: {empty}"
    groups = prom.api("rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == len(rules.recording()) + len(rules.alerts())
    assert all(r["health"] == "ok" and not r.get("lastError") for r in loaded), loaded
    firing = [r["name"] for r in loaded if r["type"] == "alerting" and r["state"] != "inactive"]
    assert firing == []  # a healthy stack raises no alert


def wait_for_data(prom: PrometheusServer, expr: str, timeout: float = 20.0) -> bool:
    """Whether ``expr`` returns a non-empty result within ``timeout`` (rules and rates need a few samples)."""
    deadline = time.monotonic() + timeout
    while True:
        if prom.query(expr):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
