"""GrafanaDashboard: builds one Grafana dashboard JSON model (panels laid out on a grid, pool variables)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
# The series every pool exports (the router's request counter): what the namespace/pool pickers list.
VARIABLE_METRIC = "kvferry_router_requests_total"
# Dashboard variables, as panel queries write them; ``queries_for`` substitutes them.
POOL_SELECTOR = 'namespace="$namespace",pool="$pool"'
RATE = "$__rate_interval"

PanelType = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel and its legend."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A panel: its type, title, unit, width (of 24) and queries."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: PanelType = "timeseries"
    width: int = 12
    description: str = ""


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": False,
        "multi": False,
    }


@dataclass
class GrafanaDashboard:
    """A dashboard with the datasource / namespace / pool variables and panels in rows of 24 columns."""

    uid: str
    title: str
    description: str
    panels: list[Panel] = field(default_factory=list)

    def add(self, *panels: Panel) -> GrafanaDashboard:
        self.panels.extend(panels)
        return self

    def _panel_json(self, pid: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
        height = 4 if panel.kind == "stat" else 8
        out: dict[str, Any] = {
            "id": pid,
            "type": panel.kind,
            "title": panel.title,
            "description": panel.description,
            "datasource": DATASOURCE,
            "gridPos": {"x": x, "y": y, "w": panel.width, "h": height},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DATASOURCE,
                    "expr": q.expr,
                    "legendFormat": q.legend,
                }
                for i, q in enumerate(panel.queries)
            ],
        }
        if panel.kind == "stat":
            out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
        else:
            out["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}}
        return out

    def to_json(self) -> dict[str, Any]:
        """The dashboard JSON model Grafana imports (and its sidecar loads from a ConfigMap)."""
        panels, x, y, row_height = [], 0, 0, 0
        for pid, panel in enumerate(self.panels, start=1):
            if x + panel.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            item = self._panel_json(pid, panel, x, y)
            panels.append(item)
            x += panel.width
            row_height = max(row_height, item["gridPos"]["h"])
        namespaces = f"label_values({VARIABLE_METRIC}, namespace)"
        pools = f'label_values({VARIABLE_METRIC}{{namespace="$namespace"}}, pool)'
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["kvferry"],
            "editable": True,
            "schemaVersion": 39,
            "version": 1,
            "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"},
            "timezone": "browser",
            "templating": {
                "list": [
                    {
                        "name": "datasource",
                        "label": "Data source",
                        "type": "datasource",
                        "query": "prometheus",
                    },
                    _variable("namespace", "Namespace", namespaces),
                    _variable("pool", "Pool", pools),
                ]
            },
            "annotations": {"list": []},
            "links": [],
            "panels": panels,
        }


def queries_for(dashboard: dict[str, Any], namespace: str, pool: str, rate: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a dashboard JSON, its variables substituted."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate)
            expr = expr.replace("$namespace", namespace).replace("$pool", pool)
            out.append((panel["title"], expr))
    return out
