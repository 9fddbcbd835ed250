"""Renders one generated Grafana dashboard to a PNG from its panels' real query results (matplotlib).

Grafana cannot be installed here; this draws the same grid (gridPos), the same queries (variables
substituted) and legends, from Prometheus' query_range answers, in Grafana's dark colours.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pool_operator.dashboards import OUT_DIR
from services.scrape_targets import LOCAL_NAMESPACE, LOCAL_POOL
from tests.monitoring.prometheus_server import PrometheusServer

BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
UNIT_SCALE = {"s": ("ms", 1000.0), "percentunit": ("%", 100.0)}


def _legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out or ",".join(f"{k}={v}" for k, v in labels.items())


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "bool_on_off":
        return "ON" if value else "OFF"
    suffix, scale = UNIT_SCALE.get(unit, ("", 1.0))
    return f"{value * scale:.3g}{suffix}"


def _series(
    prom: PrometheusServer, panel: dict[str, Any], start: float, end: float
) -> list[tuple[str, list, list]]:
    out = []
    for target in panel["targets"]:
        expr = target["expr"].replace("$__rate_interval", "10s")
        expr = expr.replace("$namespace", LOCAL_NAMESPACE).replace("$pool", LOCAL_POOL)
        for s in prom.query_range(expr, start, end, 1.0):
            xs = [float(t) - start for t, _ in s["values"]]
            ys = [float(v) for _, v in s["values"]]
            out.append((_legend(target["legendFormat"], s["metric"]), xs, ys))
    return out


def render_dashboard(prom: PrometheusServer, file_name: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads((OUT_DIR / file_name).read_text())
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(16, rows * 0.42 + 0.8), facecolor=BACKGROUND)
    grid = fig.add_gridspec(
        rows,
        24,
        left=0.03,
        right=0.99,
        top=1 - 0.8 / (rows * 0.42 + 0.8),
        bottom=0.03,
        hspace=3.0,
        wspace=1.2,
    )
    fig.suptitle(
        f"{dashboard['title']}  (pool {LOCAL_NAMESPACE}/{LOCAL_POOL}, real kvferry up + Prometheus; x: seconds since the traffic started)",
        color=TEXT,
        x=0.03,
        ha="left",
        fontsize=13,
    )
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        ax = fig.add_subplot(grid[g["y"] : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        ax.set_facecolor(PANEL)
        ax.set_title(panel["title"], color=TEXT, fontsize=9, loc="left")
        for spine in ax.spines.values():
            spine.set_color(GRID)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        series = _series(prom, panel, start, end)
        if panel["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            text = (
                "  ".join(
                    f"{name}: {_fmt(ys[-1], unit)}" if len(series) > 1 else _fmt(ys[-1], unit)
                    for name, _, ys in series
                )
                or "no data"
            )
            ax.text(
                0.5,
                0.4,
                text,
                color="#73bf69",
                fontsize=16 if len(series) < 2 else 11,
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontweight="bold",
            )
            continue
        _, scale = UNIT_SCALE.get(unit, ("", 1.0))
        for name, xs, ys in series:
            ax.plot(xs, [y * scale for y in ys], linewidth=1.4, label=name)
        ax.tick_params(colors=TEXT, labelsize=7)
        ax.grid(color=GRID, linewidth=0.5)
        suffix = UNIT_SCALE.get(unit, ("", 1.0))[0]
        if suffix:
            ax.set_ylabel(suffix, color=TEXT, fontsize=7)
        if series:
            ax.legend(fontsize=7, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="upper left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=BACKGROUND)
    plt.close(fig)
