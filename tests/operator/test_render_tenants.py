"""spec.router.tenants: rendered into the routers' tenants file (keys by variable from their Secrets, in a
ConfigMap of the routers alone), the file parses with the router's own loader, and bad tenants are refused
at render naming the field; a role that may scale to zero turns the routers' flow control on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from services.cli import main as kvferry
from services.router.admission.tenants import Band, load_tenants
from tests.operator.conftest import load_example
from tests.operator.test_render import IMAGES, by_name

TENANTS = [
    {"name": "search", "apiKeySecretRef": {"name": "keys", "key": "search"}, "band": "critical"},
    {
        "name": "batch",
        "apiKeySecretRef": {"name": "keys", "key": "batch"},
        "band": "sheddable",
        "quota": {"tokensPerMinute": 100000, "maxConcurrent": 4},
    },
]


def _render(tenants: list[dict]) -> list[dict]:
    body = load_example("aggregated-pool.yaml")
    body["spec"]["router"]["tenants"] = tenants
    return PoolRenderer(parse_pool(body), IMAGES).render()


def test_tenants_reach_the_routers_as_a_file_and_secret_keyed_variables(tmp_path: Path) -> None:
    rendered = _render(TENANTS)
    router = by_name(rendered, "Deployment", "smollm-router")
    pod = router["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    path = args[args.index("--tenants-file") + 1]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
    assert path.startswith(mount["mountPath"] + "/")
    config = by_name(rendered, "ConfigMap", "smollm-router-tenants")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tenants")
    assert volume["configMap"]["name"] == "smollm-router-tenants"
    env = {e["name"]: e for e in container["env"]}
    file = tmp_path / "tenants.json"
    file.write_text(config["data"][path.rsplit("/", 1)[1]])
    assert "keys" not in file.read_text()  # the file names variables, never keys or their Secrets
    values = {}
    for tenant in TENANTS:
        var = next(
            n
            for n, e in env.items()
            if e.get("valueFrom", {}).get("secretKeyRef") == tenant["apiKeySecretRef"]
        )
        values[var] = f"key-of-{tenant['name']}"
    tenants, keys = load_tenants(file, env=values)  # the router's own loader reads what was rendered
    assert [(t.name, t.band) for t in tenants] == [("search", Band.critical), ("batch", Band.sheddable)]
    assert tenants[1].quota.tokens_per_minute == 100000 and tenants[1].quota.max_concurrent == 4
    assert keys == ["key-of-search", "key-of-batch"]
    # a tenant change rolls the routers alone: the engines' pods do not change
    other = _render([TENANTS[0]])
    engine = by_name(rendered, "Deployment", "smollm-engine")
    assert by_name(other, "Deployment", "smollm-engine")["spec"] == engine["spec"]
    assert by_name(other, "Deployment", "smollm-router")["spec"]["template"]["metadata"] != pod["metadata"]


@pytest.mark.parametrize(
    ("tenant", "field"),
    [
        ({**TENANTS[0], "band": "urgent"}, "spec.router.tenants.0.band"),
        ({**TENANTS[0], "quota": {"tokensPerMinute": -1}}, "spec.router.tenants.0.quota.tokensPerMinute"),
        ({**TENANTS[0], "apiKeySecretRef": None}, "spec.router.tenants.0.apiKeySecretRef"),
    ],
)
def test_bad_tenants_are_refused_at_render_naming_the_field(
    tenant: dict, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = load_example("aggregated-pool.yaml")
    body["spec"]["router"]["tenants"] = [tenant]
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(body))
    assert kvferry(["render", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_duplicate_tenant_names_are_refused() -> None:
    with pytest.raises(ValueError, match="tenants: each name must be unique"):
        _render([TENANTS[0], {**TENANTS[1], "name": "search"}])


def test_a_role_that_scales_to_zero_turns_flow_control_on() -> None:
    body = load_example("aggregated-pool.yaml")
    target = {"metric": "KVCacheUsage", "averageValue": 0.7}
    body["spec"]["autoscaling"] = {"decode": {"minReplicas": 0, "maxReplicas": 3, "target": target}}
    router = by_name(PoolRenderer(parse_pool(body), IMAGES).render(), "Deployment", "smollm-router")
    assert "--flow-control" in router["spec"]["template"]["spec"]["containers"][0]["args"]
    body["spec"]["autoscaling"]["decode"]["minReplicas"] = 1
    router = by_name(PoolRenderer(parse_pool(body), IMAGES).render(), "Deployment", "smollm-router")
    assert "--flow-control" not in router["spec"]["template"]["spec"]["containers"][0]["args"]
