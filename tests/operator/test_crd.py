"""The generated CRD: no drift, valid for k8s 1.32-1.37, examples accepted, bad pools rejected by name."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pool_operator.crdgen import CRD_FILENAME, CrdGenerator
from pool_operator.poolfile import PoolFileError, parse_pool
from tests.operator.conftest import REPO, load_example
from tests.operator.crd_validator import CrdValidator

MINORS = ("1.32", "1.33", "1.34", "1.35", "1.36", "1.37")


@pytest.fixture(scope="module")
def validator() -> CrdValidator:
    return CrdValidator()


def test_committed_crds_match_the_models(tmp_path):
    CrdGenerator().write((tmp_path,))
    fresh = (tmp_path / CRD_FILENAME).read_text()
    for folder in ("crds", "charts/kvferry/crds"):
        committed = (REPO / folder / CRD_FILENAME).read_text()
        assert committed == fresh, f"{folder}/{CRD_FILENAME} drifted from models.py: run `make crds`"


@pytest.mark.parametrize("minor", MINORS)
def test_crd_is_a_valid_customresourcedefinition(minor):
    crd = yaml.safe_load((REPO / "crds" / CRD_FILENAME).read_text())
    assert kubernetes_validate.validate(crd, minor, strict=True)


def test_crd_surface():
    crd = CrdGenerator().crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["kfpool"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Mode", "Phase", "Ready", "Endpoint"}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["engine"]["properties"]["blockSize"]["default"] == 16
    assert spec["properties"]["router"]["properties"]["strategy"]["enum"] == [
        "PrefixAware",
        "LeastLoad",
        "RoundRobin",
    ]


@pytest.mark.parametrize("name", ["aggregated-pool.yaml", "disaggregated-pool.yaml", "embedding-pool.yaml"])
def test_examples_are_accepted_by_schema_cel_and_models(validator, name):
    example = load_example(name)
    assert validator.errors(example) == []
    assert parse_pool(example).metadata.name == example["metadata"]["name"]


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value
    return obj


_DELETE = object()
SLO = {
    "ttftSeconds": 2,
    "itlSeconds": 0.1,
    "prefill": {"minReplicas": 1, "maxReplicas": 4},
    "decode": {"minReplicas": 1, "maxReplicas": 8},
}
# (example, path, value, text that both the CRD and the models must report)
INVALID = [
    (
        "disaggregated-pool.yaml",
        "spec.prefill",
        _DELETE,
        "spec.prefill is required when mode is Disaggregated",
    ),
    (
        "aggregated-pool.yaml",
        "spec.prefill",
        {"replicas": 1},
        "spec.prefill must be omitted when mode is Aggregated",
    ),
    (
        "disaggregated-pool.yaml",
        "spec.autoscaling.decode.minReplicas",
        9,
        "minReplicas must be <= maxReplicas",
    ),
    (
        "disaggregated-pool.yaml",
        "spec.autoscaling.prefillDecodeRatio",
        {"min": 2, "max": 1},
        "prefillDecodeRatio.min must be <= max",
    ),
    (
        "aggregated-pool.yaml",
        "spec.model.source",
        {"pvc": {"claimName": "m"}, "hostPath": "/m"},
        "exactly one of pvc, hostPath must be set",
    ),
    (
        "aggregated-pool.yaml",
        "spec.redis",
        {"managed": True, "url": "redis://r:6379"},
        "exactly one of url, secretRef, managed: true must be set",
    ),
    (
        "aggregated-pool.yaml",
        "spec.engine.maxNumBatchedTokens",
        64,
        "maxNumBatchedTokens must be >= maxNumSeqs",
    ),
    ("aggregated-pool.yaml", "spec.model.source.pvc.path", "../etc", "must not contain '..'"),
    (
        "aggregated-pool.yaml",
        "spec.autoscaling",
        {"prefill": {"maxReplicas": 2, "target": {"metric": "WaitingRequests", "averageValue": 1}}},
        "autoscaling.prefill needs mode Disaggregated",
    ),
    (
        "disaggregated-pool.yaml",
        "spec.autoscaling.decode.target.averageValue",
        5,
        "a KVCacheUsage target is a ratio in (0, 1]",
    ),
    ("disaggregated-pool.yaml", "spec.autoscaling.slo", SLO, "autoscaling.slo replaces autoscaling.prefill"),
    ("aggregated-pool.yaml", "spec.autoscaling", {"slo": SLO}, "autoscaling.slo needs mode Disaggregated"),
    (
        "disaggregated-pool.yaml",
        "spec.autoscaling",
        {"slo": {**SLO, "decode": {"minReplicas": 9, "maxReplicas": 2}}},
        "minReplicas must be <= maxReplicas",
    ),
]
SLO_SCHEMA = [  # spec.autoscaling.slo of the disaggregated example: each bad value named
    ("ttftSeconds", 0),
    ("itlSeconds", -1),
    ("forecastSeconds", 7200),
    ("maxStepReplicas", 0),
    ("decode", {"minReplicas": 0, "maxReplicas": 2}),
    ("timingConfigMap", {"name": "Bad_Name"}),
]


@pytest.mark.parametrize(("field", "value"), SLO_SCHEMA, ids=[i[0] for i in SLO_SCHEMA])
def test_slo_fields_are_checked_and_named(validator, field, value):
    pool = _set(load_example("disaggregated-pool.yaml"), "spec.autoscaling", {"slo": {**SLO, field: value}})
    assert any(field in e for e in validator.errors(pool)), validator.errors(pool)
    with pytest.raises(PoolFileError) as raised:
        parse_pool(pool)
    assert field in str(raised.value)
    fine = _set(load_example("disaggregated-pool.yaml"), "spec.autoscaling", {"slo": SLO})
    assert validator.errors(fine) == [] and parse_pool(fine).spec.autoscaling.slo is not None


# Schema-level (types, enums, bounds, unknown fields): each layer words it its own way; both name the field.
INVALID_SCHEMA = [
    ("spec.engine.blockSize", 0, "blockSize"),
    ("spec.engine.dtype", "int4", "dtype"),
    ("spec.router.strategy", "Random", "strategy"),
    ("spec.engine.gpuMemoryUtilization", 0, "gpuMemoryUtilization"),
    ("spec.engine.speculative", True, "speculative"),
    ("spec.kvstore.capacity", "lots", "capacity"),
    ("spec.model.source.uri", "hf://org/model", "uri"),  # gone: nothing would fetch it
]


@pytest.mark.parametrize(("example", "path", "value", "message"), INVALID, ids=[i[3][:40] for i in INVALID])
def test_cel_rules_and_models_reject_with_the_same_message(validator, example, path, value, message):
    pool = _set(load_example(example), path, value)
    assert any(message in e for e in validator.errors(pool)), validator.errors(pool)
    with pytest.raises(PoolFileError) as raised:
        parse_pool(pool)
    assert message in str(raised.value)


@pytest.mark.parametrize(("path", "value", "field"), INVALID_SCHEMA, ids=[i[0] for i in INVALID_SCHEMA])
def test_schema_and_models_reject_and_name_the_field(validator, path, value, field):
    pool = _set(load_example("aggregated-pool.yaml"), path, value)
    assert any(field in e for e in validator.errors(pool)), validator.errors(pool)
    with pytest.raises(PoolFileError) as raised:
        parse_pool(pool)
    assert field in str(raised.value)


def test_block_size_is_immutable_on_update(validator):
    old = load_example("aggregated-pool.yaml")
    assert validator.errors(_set(old, "spec.engine.maxNumSeqs", 64), old=old) == []
    errors = validator.errors(_set(old, "spec.engine.blockSize", 32), old=old)
    assert any("blockSize is immutable" in e for e in errors)


def test_defaults_of_crd_and_models_agree(validator):
    from tests.operator.crd_validator import apply_defaults

    minimal = {
        "apiVersion": "kvferry.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "m"},
        "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "m"}}}},
    }
    defaulted = apply_defaults(validator.schema, copy.deepcopy(minimal))["spec"]
    model = parse_pool(minimal).spec.model_dump(by_alias=True, exclude_none=True)
    for section in ("engine", "router", "kvstore", "redis", "decode"):
        for key, value in defaulted[section].items():
            assert model[section][key] == value, f"{section}.{key}"
