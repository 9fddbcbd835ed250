"""The rendered PrometheusRule through the real promtool: `check rules` and the rule unit tests in promtool/."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pool_operator.dashboards import all_dashboards
from pool_operator.grafana_dashboard import queries_for
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from tests.operator.conftest import REPO, load_example

UNIT_TESTS = REPO / "tests" / "operator" / "promtool" / "kvferry_rules_test.yaml"


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip("promtool is not installed: run `make setup` (Debian package prometheus)")
    return found


def rendered_groups() -> list[dict]:
    """The groups of the PrometheusRule the operator renders for examples/monitored-pool.yaml."""
    manifests = PoolRenderer(parse_pool(load_example("monitored-pool.yaml"))).render()
    (rule,) = [m for m in manifests if m["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rendered_groups()}, sort_keys=False))
    out = run("check", "rules", "rules.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 16 rules found" in out.stdout


def test_promtool_unit_tests_pass_and_can_fail(tmp_path: Path) -> None:
    (tmp_path / "kvferry_rules.yaml").write_text(
        yaml.safe_dump({"groups": rendered_groups()}, sort_keys=False)
    )
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    out = run("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # The same tests against a rule file whose KV alert threshold moved must fail.
    broken = yaml.safe_dump({"groups": rendered_groups()}, sort_keys=False).replace("> 0.9", "> 0.96")
    (tmp_path / "kvferry_rules.yaml").write_text(broken)
    out = run("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0 and "KvferryKVCacheNearlyFull" in out.stdout + out.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel query (variables substituted) as a recording rule's expression."""
    rules = [
        {"record": f"panel:{i}", "expr": expr}
        for i, (_, expr) in enumerate(
            q for d in all_dashboards().values() for q in queries_for(d, "llm", "chat", "1m")
        )
    ]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = run("check", "rules", "panels.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout
