"""Helm chart (lint, template, valid objects, least-privilege RBAC) and image names across render/chart/Dockerfile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pool_operator.images import COMPONENTS, REGISTRY, ImageSet, package_version
from pool_operator.kubeclient import KINDS
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from tests.operator.conftest import REPO, load_example
from tests.operator.crd_validator import CrdValidator
from tests.operator.test_crd import MINORS

CHART = REPO / "charts" / "kvferry"


def helm_binary() -> str:
    local = Path(sys.executable).parent / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    if not found:
        pytest.skip("helm is not installed: run `make helm`")
    return found


def helm(*args: str) -> str:
    result = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


VARIANTS = {
    "default": [],
    "namespaced-with-sample": [
        "--set",
        "operator.watchNamespaces={llm,batch}",
        "--set",
        "samplePool.enabled=true",
    ],
}


def test_helm_lint_strict():
    for extra in VARIANTS.values():
        helm("lint", "--strict", str(CHART), *extra)


def test_values_schema_rejects_unknown_values():
    result = subprocess.run(
        [helm_binary(), "template", "r", str(CHART), "--set", "operator.replicas=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "replicas" in result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_template_output_is_valid(variant):
    documents = [
        d
        for d in yaml.safe_load_all(
            helm("template", "r", str(CHART), "--namespace", "ops", "--include-crds", *VARIANTS[variant])
        )
        if d
    ]
    kinds = [d["kind"] for d in documents]
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    for document in documents:
        if document["kind"] == "InferencePool":
            assert CrdValidator().errors(document) == []
            assert parse_pool(document).metadata.namespace == "ops"
            continue
        for minor in MINORS:
            assert kubernetes_validate.validate(document, minor, strict=True)


def _rules(documents: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for d in documents
        if d["kind"] in ("ClusterRole", "Role")
        for rule in d["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_covers_what_the_operator_manages_and_no_wildcards():
    """Each managed kind: listed, applied (create + patch) and pruned; Pods listed and annotated; Secrets
    only created (tests/operator/test_rbac.py holds the grants to the calls the operator makes)."""
    documents = list(yaml.safe_load_all(helm("template", "r", str(CHART))))
    rules = _rules(documents)
    for kind, (api_version, plural) in KINDS.items():
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        needed = {"Pod": ("list", "patch"), "Secret": ("create",)}.get(
            kind, ("list", "create", "patch", "delete")
        )
        for verb in needed:
            assert (group, plural, verb) in rules, f"RBAC lacks {verb} {plural}.{group}"
    assert not any(resource == "*" or verb == "*" for _, resource, verb in rules)
    assert {verb for _, resource, verb in rules if resource == "secrets"} == {"create"}  # never read one
    namespaced = list(
        yaml.safe_load_all(helm("template", "r", str(CHART), *VARIANTS["namespaced-with-sample"]))
    )
    assert [d["metadata"]["namespace"] for d in namespaced if d and d["kind"] == "Role"] == ["llm", "batch"]
    assert not any(
        d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "r-operator" for d in namespaced
    )


def test_image_names_agree_between_render_chart_dockerfile_and_makefile():
    version = package_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version and values["image"]["registry"] == REGISTRY
    targets = re.findall(r"^FROM \S+ AS ([\w-]+)$", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert set(COMPONENTS) <= set(targets)
    makefile = (REPO / "Makefile").read_text()
    # make images builds ImageSet's names (pool_operator.image_build), so only the registry is repeated
    assert f"IMAGE_REGISTRY ?= {REGISTRY}" in makefile and "-m pool_operator.image_build" in makefile
    operator = next(
        d for d in yaml.safe_load_all(helm("template", "r", str(CHART))) if d["kind"] == "Deployment"
    )
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"] == ImageSet().image("operator")
    images = {
        c["image"]
        for m in PoolRenderer(parse_pool(load_example("disaggregated-pool.yaml"))).render()
        if m["kind"] == "Deployment"
        for c in m["spec"]["template"]["spec"]["containers"]
    }
    assert {ImageSet().image(c) for c in ("engine", "router", "kvstore")} <= images
    cpu_pool = PoolRenderer(parse_pool(load_example("embedding-pool.yaml"))).render()
    assert ImageSet().image("engine-cpu") in {
        c["image"]
        for m in cpu_pool
        if m["kind"] == "Deployment"
        for c in m["spec"]["template"]["spec"]["containers"]
    }
    assert all(
        image == f"{REGISTRY}/kvferry-{c}:{version}" for c in COMPONENTS for image in [ImageSet().image(c)]
    )


def _dashboard_maps(*extra: str) -> list[dict]:
    documents = yaml.safe_load_all(helm("template", "r", str(CHART), "--namespace", "ops", *extra))
    return [d for d in documents if d and d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]]


def test_dashboards_are_configmaps_for_the_grafana_sidecar():
    from pool_operator.dashboards import all_dashboards

    maps = _dashboard_maps()
    wanted = all_dashboards()
    assert len(maps) == len(wanted)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "ops"
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == wanted[name]
    custom = _dashboard_maps(
        "--set",
        "dashboards.label=kvferry_dash",
        "--set-string",
        "dashboards.labelValue=yes",
        "--set",
        "dashboards.namespace=monitoring",
        "--set",
        "dashboards.annotations.grafana_folder=kvferry",
    )
    for cm in custom:
        assert (
            cm["metadata"]["labels"]["kvferry_dash"] == "yes"
            and "grafana_dashboard" not in cm["metadata"]["labels"]
        )
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "kvferry"}
    assert _dashboard_maps("--set", "dashboards.enabled=false") == []
    bad = subprocess.run(
        [helm_binary(), "template", "r", str(CHART), "--set", "dashboards.label=not a label"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "label" in bad.stderr
