"""Every PromQL the monitoring ships (dashboard panels, recording rules, alerts) and the metric names in it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pool_operator.dashboards import all_dashboards
from pool_operator.grafana_dashboard import queries_for
from pool_operator.pool_rules import PoolRules

# Series Prometheus makes itself (not in any /metrics text).
SYNTHETIC = frozenset({"up"})
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


@dataclass(frozen=True)
class Shipped:
    """One query: where it comes from (``dashboard/panel`` or ``record``/``alert`` name) and its PromQL."""

    source: str
    expr: str


def panel_queries(namespace: str, pool: str, rate: str = "1m") -> list[Shipped]:
    return [
        Shipped(f"{d['title']} / {title}", expr)
        for d in all_dashboards().values()
        for title, expr in queries_for(d, namespace, pool, rate)
    ]


def rule_queries(namespace: str, pool: str) -> list[Shipped]:
    rules = PoolRules(namespace, pool)
    return [Shipped(r["record"], r["expr"]) for r in rules.recording()] + [
        Shipped(r["alert"], r["expr"]) for r in rules.alerts()
    ]


def metric_names(expr: str) -> set[str]:
    """The metric names a query selects (every selector in our queries carries the pool's labels)."""
    return set(_SELECTOR.findall(expr))


def scraped_names(text: str) -> set[str]:
    """Sample names of a Prometheus text exposition (``name{...} v`` or ``name v``)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
