"""No silent pool field: every field of the pool spec (not only spec.engine, which test_render_engine_fields
covers flag by flag) changes what the operator renders, and every rendered kvferry command line parses with
the real CLI parsers."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pool_operator.models import (
    InferencePoolSpec,
    KVStoreSpec,
    ModelSpec,
    RedisSpec,
    RoleSpec,
    RouterSpec,
)
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from services.cli import build_parser
from tests.operator.conftest import load_example
from tests.operator.test_render import IMAGES, UID

SECRET_REF = {"name": "s", "key": "k"}
# (section, camelCase field, a valid non-default value) for every field of each section
FIELDS: dict[type, tuple[str, dict[str, Any]]] = {
    RouterSpec: (
        "router",
        {
            "image": "registry.example/router:x",
            "replicas": 3,
            "strategy": "LeastLoad",
            "weights": {"prefix": 5, "queue": 1, "kv": 1},
            "tierWeights": {"disk": 0.5, "routed": 0.8},
            "pdThreshold": 64,
            "service": {"type": "NodePort", "port": 81},
            "apiKeySecretRef": SECRET_REF,
            "saltFromApiKey": True,
            "sessionAffinity": {"stickyLimitTokens": 4096, "ttlSeconds": 600},
            "tenants": [{"name": "t", "apiKeySecretRef": SECRET_REF, "band": "critical"}],
            "resources": {"requests": {"cpu": "2"}},
        },
    ),
    KVStoreSpec: (
        "kvstore",
        {"enabled": True, "image": "registry.example/kv:x", "replicas": 2, "capacity": "3Gi"},
    ),
    RedisSpec: (
        "redis",
        {"url": "redis://r:6379/0", "secretRef": SECRET_REF, "managed": True, "image": "r:x"},
    ),
    RoleSpec: (
        "decode",
        {
            "replicas": 5,
            "resources": {"requests": {"cpu": "9", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
            "nodeSelector": {"pool": "a"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {}},
            "podAnnotations": {"a": "b"},
        },
    ),
    ModelSpec: (
        "model",
        {"name": "other-name", "source": {"pvc": {"claimName": "other"}}, "tokenizer": "tok"},
    ),
}
TOP = {  # spec fields beyond the sections above (engine: test_render_engine_fields)
    "mode": ("Disaggregated", {"prefill": {"replicas": 1}}),
    "prefill": None,  # with mode above
    "autoscaling": (
        {"decode": {"maxReplicas": 4, "target": {"metric": "KVCacheUsage", "averageValue": 0.8}}},
        {},
    ),
    "loras": ([{"name": "a", "source": "adapters/a"}], {}),
    "monitoring": ({"monitor": "PodMonitor"}, {}),
    "gateway": ({"enabled": True}, {}),
}
EXCLUSIVE = {("redis", "url"), ("redis", "secretRef"), ("redis", "managed")}  # one of three


def _render(body: dict[str, Any]) -> list[dict[str, Any]]:
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = UID
    return PoolRenderer(parse_pool(body), IMAGES).render()


def _set(body: dict[str, Any], section: str, field: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    part = out["spec"].setdefault(section, {})
    if (section, field) in EXCLUSIVE:
        part.clear()
    part[field] = value
    return out


def _base(body: dict[str, Any], section: str, field: str) -> dict[str, Any]:
    """What a field's value is compared with: the example, with what the field needs to matter."""
    if section == "kvstore" and field != "enabled":
        return _set(body, "kvstore", "enabled", True)  # a disabled store renders nothing to change
    if (section, field) == ("router", "saltFromApiKey"):
        return _set(body, "router", "apiKeySecretRef", SECRET_REF)
    if (section, field) == ("redis", "managed"):
        return _set(body, "redis", "url", "redis://r:6379/0")
    if (section, field) == ("redis", "image"):
        return body  # managed (the example's): the image of the managed Redis
    return body


@pytest.mark.parametrize("model", list(FIELDS), ids=lambda m: m.__name__)
def test_every_field_of_each_section_changes_the_render(model: type) -> None:
    section, values = FIELDS[model]
    camel = {f.alias or name for name, f in model.model_fields.items()}
    assert set(values) == camel, f"{model.__name__}: a field needs a value here"
    example = load_example("aggregated-pool.yaml")
    for field, value in values.items():
        base = _base(example, section, field)
        body = copy.deepcopy(base)
        body["spec"].setdefault(section, {})[field] = value
        if (section, field) in EXCLUSIVE:
            body["spec"][section] = {field: value}
        assert _render(body) != _render(base), f"spec.{section}.{field} reaches nothing"


@pytest.mark.parametrize("field", [f for f in TOP if TOP[f] is not None])
def test_every_top_level_field_changes_the_render(field: str) -> None:
    assert set(TOP) | {"model", "engine", "router", "kvstore", "redis", "decode"} == {
        f.alias or n for n, f in InferencePoolSpec.model_fields.items()
    }
    value, extra = TOP[field]
    base_body = load_example("aggregated-pool.yaml")
    body = copy.deepcopy(base_body)
    body["spec"][field] = value
    body["spec"].update(extra)
    assert _render(body) != _render(base_body), f"spec.{field} reaches nothing"


@pytest.mark.parametrize(
    "example", ["aggregated-pool.yaml", "disaggregated-pool.yaml", "embedding-pool.yaml", "gateway-pool.yaml"]
)
def test_every_rendered_command_line_parses_with_the_real_cli(example: str) -> None:
    parsed = 0
    for manifest in _render(load_example(example)):
        if manifest["kind"] != "Deployment":
            continue
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            if container.get("command") == ["kvferry"]:
                args = container["args"]
                build_parser(args).parse_args(args)  # SystemExit on any flag the CLI does not take
                parsed += 1
    assert parsed >= 2
