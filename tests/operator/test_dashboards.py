"""Grafana dashboards as code: the committed JSON equals the generator's, and every panel queries this pool."""

from __future__ import annotations

import json
import re

from pool_operator.dashboards import OUT_DIR, all_dashboards, dump, main
from pool_operator.grafana_dashboard import queries_for

TITLES = {
    "kvferry-pool.json": "kvferry / Pool overview",
    "kvferry-latency.json": "kvferry / Latency by role",
    "kvferry-kv-cache.json": "kvferry / KV cache and prefix hits",
    "kvferry-transfers.json": "kvferry / P/D transfers",
    "kvferry-router.json": "kvferry / Router",
}


def test_committed_dashboards_match_the_generator():
    wanted = all_dashboards()
    assert {name: d["title"] for name, d in wanted.items()} == TITLES
    for name, dashboard in wanted.items():
        assert (OUT_DIR / name).read_text() == dump(dashboard), (
            f"{name} drifted: run `python -m pool_operator.dashboards`"
        )
    assert sorted(p.name for p in OUT_DIR.glob("*.json")) == sorted(wanted)
    assert main(["--check"]) == 0


def test_check_fails_on_a_drifted_or_stray_file(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    first = tmp_path / "kvferry-pool.json"
    first.write_text(first.read_text().replace("Requests / s", "Requests per second"))
    (tmp_path / "old.json").write_text("{}")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "kvferry-pool.json" in err and "old.json" in err


def test_panels_are_laid_out_and_select_the_chosen_pool():
    for name, dashboard in all_dashboards().items():
        json.dumps(dashboard)  # serialisable
        uids = [v["name"] for v in dashboard["templating"]["list"]]
        assert uids == ["datasource", "namespace", "pool"], name
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                # every metric selector in the query names the dashboard's pool
                selectors = re.findall(r"(kvferry_\w+|\bup)\{([^}]*)\}", target["expr"])
                assert selectors, target["expr"]
                assert all('namespace="$namespace",pool="$pool"' in s for _, s in selectors), target["expr"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for _, expr in queries_for(dashboard, "llm", "chat", "1m"):
            assert "$" not in expr
