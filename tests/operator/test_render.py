"""render: golden output, kubernetes-validate strict for 1.32-1.37, contracts, and `kvferry render`."""

from __future__ import annotations

import os

import kubernetes_validate
import pytest
import yaml

from pool_operator.images import ImageSet
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer, manifest_key
from services.cli import main as kvferry
from services.common.kv.hashing import HASH_VERSION
from services.common.pool.pod_labels import APPLIED_HASH_ANNOTATION, DRAINING_ANNOTATION
from tests.operator.conftest import EXAMPLES, REPO, load_example
from tests.operator.test_crd import MINORS

GOLDEN = REPO / "tests" / "operator" / "golden"
IMAGES = ImageSet(version="0.1.0")
UID = "0b7c6d2e-1111-4a5b-9c3d-000000000001"


def render(name: str, uid: str | None = None) -> list[dict]:
    body = load_example(name)
    if uid:
        body["metadata"]["uid"] = uid
    return PoolRenderer(parse_pool(body), IMAGES).render()


def by_name(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


@pytest.mark.parametrize("name", ["aggregated-pool.yaml", "disaggregated-pool.yaml", "embedding-pool.yaml"])
def test_golden(name):
    text = yaml.safe_dump_all(render(name, UID), sort_keys=False, width=120)
    golden = GOLDEN / name
    if os.environ.get("KVFERRY_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"render output changed; review, then KVFERRY_UPDATE_GOLDEN=1 ({golden})"
    )


@pytest.mark.parametrize("name", ["aggregated-pool.yaml", "disaggregated-pool.yaml", "embedding-pool.yaml"])
def test_every_object_is_valid_kubernetes(name):
    for manifest in render(name, UID):
        for minor in MINORS:
            assert kubernetes_validate.validate(manifest, minor, strict=True)


def test_render_is_deterministic_and_stamped():
    first, second = render("disaggregated-pool.yaml", UID), render("disaggregated-pool.yaml", UID)
    assert first == second
    for manifest in first:
        meta = manifest["metadata"]
        assert meta["labels"]["kvferry.dev/pool"] == "llama-pd"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvferry-operator"
        assert meta["ownerReferences"][0]["uid"] == UID
        assert len(meta["annotations"][APPLIED_HASH_ANNOTATION]) == 16
    assert all("ownerReferences" not in m["metadata"] for m in render("disaggregated-pool.yaml"))


def test_disaggregated_roles_config_and_security():
    manifests = render("disaggregated-pool.yaml", UID)
    deployments = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    assert set(deployments) == {"llama-pd-prefill", "llama-pd-decode", "llama-pd-router", "llama-pd-kvstore"}
    config = by_name(manifests, "ConfigMap", "llama-pd-config")["data"]
    assert config == {
        "model-id": "llama-3.1-8b-instruct",
        "block-size": "16",
        "hash-version": str(HASH_VERSION),
        "mode": "Disaggregated",
    }
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert deployment["spec"]["template"]["metadata"]["labels"]["kvferry.dev/role"] in (
            "prefill",
            "decode",
            "router",
            "kvstore",
        )
        if name != "llama-pd-kvstore":
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # autoscaled roles leave replicas to the autoscaler; the router keeps its declared count
    assert "replicas" not in deployments["llama-pd-prefill"]["spec"]
    assert "replicas" not in deployments["llama-pd-decode"]["spec"]
    assert deployments["llama-pd-router"]["spec"]["replicas"] == 2


def test_engine_and_router_command_lines_follow_the_cli_contract():
    manifests = render("disaggregated-pool.yaml")
    prefill = by_name(manifests, "Deployment", "llama-pd-prefill")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert prefill["command"] == ["kvferry"]
    assert prefill["args"] == [
        "serve",
        "/models/llama-3.1-8b-instruct",
        "--served-model-name",
        "llama-3.1-8b-instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--role",
        "prefill",
        "--dtype",
        "bfloat16",
        "--quantization",
        "auto",
        "--block-size",
        "16",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--tensor-parallel-size",
        "1",
        "--gpu-memory-utilization",
        "0.9",
        "--redis-url",
        "$(KVFERRY_REDIS_URL)",
        "--kvstore-url",
        "grpc://llama-pd-kvstore.llm.svc:50051",
        "--pool-secret-file",
        "/etc/kvferry/pool-secret/token",
        "--api-key-file",
        "/etc/kvferry/pool-secret/token",
        "--log-level",
        "info",
    ]
    assert {
        "name": "KVFERRY_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "llama-pd-redis", "key": "url"}},
    } in prefill["env"]
    router = by_name(manifests, "Deployment", "llama-pd-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--redis-url",
        "$(KVFERRY_REDIS_URL)",
        "--discovery",
        "kubernetes",
        "--selector",
        "kvferry.dev/pool=llama-pd",
        "--tokenizer",
        "/models/llama-3.1-8b-instruct",
        "--strategy",
        "prefix-aware",
        "--pd-threshold",
        "512",
        "--weights",
        "prefix=2,queue=1,kv=1",
        "--engine-api-key-file",
        "/etc/kvferry/pool-secret/token",
        "--api-key-file",
        "/etc/kvferry/api-key/keys.txt",
        "--responses-key-file",
        "/etc/kvferry/pool-secret/token",
        "--pool-secret-file",
        "/etc/kvferry/pool-secret/token",
    ]
    kvstore = by_name(manifests, "Deployment", "llama-pd-kvstore")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert kvstore["args"][:10] == [
        "kvstore",
        "--host",
        "0.0.0.0",
        "--port",
        "50051",
        "--metrics-port",
        "50052",
        "--capacity-gb",
        "68.7195",
        "--redis-url",
    ]
    assert {"name": "metrics", "containerPort": 50052, "protocol": "TCP"} in kvstore["ports"]


@pytest.mark.parametrize("pool", ["disaggregated-pool.yaml", "aggregated-pool.yaml", "embedding-pool.yaml"])
def test_every_rendered_command_line_parses_with_the_real_kvferry_cli(pool: str) -> None:
    """The operator and the binaries agree: each container's args parse with `kvferry`'s own parsers."""
    from services.cli import build_parser

    for manifest in render(pool):
        if manifest["kind"] != "Deployment":
            continue
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            if container.get("command") != ["kvferry"]:
                continue
            args = container["args"]
            parsed = build_parser(args).parse_args(args)
            assert parsed.command == args[0] and callable(parsed.func), args


def test_embedding_pool_and_chat_shaping_flags_reach_engines_and_routers():
    manifests = render("embedding-pool.yaml")
    args = by_name(manifests, "Deployment", "minilm-engine")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--task") + 1] == "embed"
    body = load_example("aggregated-pool.yaml")
    body["spec"]["engine"].update(enableAutoToolChoice=True, toolCallParser="hermes", reasoningParser="qwen3")
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    for name in ("smollm-engine", "smollm-router"):
        args = by_name(rendered, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
        assert args[args.index("--reasoning-parser") + 1] == "qwen3"
    bad = load_example("disaggregated-pool.yaml")
    bad["spec"]["engine"]["task"] = "embed"
    with pytest.raises(ValueError, match="embed needs mode Aggregated"):
        parse_pool(bad)
    unparsed = load_example("aggregated-pool.yaml")
    unparsed["spec"]["engine"]["enableAutoToolChoice"] = True
    with pytest.raises(ValueError, match="needs toolCallParser"):
        parse_pool(unparsed)


def test_aggregated_pool_runs_engines_in_role_both_with_managed_redis():
    manifests = render("aggregated-pool.yaml")
    engine = by_name(manifests, "Deployment", "smollm-engine")
    assert engine["spec"]["replicas"] == 2
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "both"
    assert args[args.index("--redis-url") + 1] == "redis://smollm-redis.llm.svc:6379/0"
    assert by_name(manifests, "Service", "smollm-redis")["spec"]["ports"][0]["port"] == 6379
    policy = by_name(manifests, "NetworkPolicy", "smollm-engines")["spec"]
    router_peer = policy["ingress"][0]["from"][0]["podSelector"]
    assert router_peer["matchExpressions"][0]["values"] == ["router"]


def test_config_change_rolls_every_config_reader_but_a_resource_change_only_its_role():
    body = load_example("disaggregated-pool.yaml")

    def keyed() -> dict[tuple[str, str], dict]:
        return {manifest_key(m): m for m in PoolRenderer(parse_pool(body), IMAGES).render()}

    base = keyed()
    body["spec"]["decode"]["resources"]["limits"]["memory"] = "64Gi"
    changed = keyed()
    assert {key for key in base if base[key] != changed[key]} == {("Deployment", "llama-pd-decode")}
    body["spec"]["model"]["name"] = "renamed"
    renamed = keyed()
    assert {
        ("Deployment", "llama-pd-prefill"),
        ("Deployment", "llama-pd-router"),
        ("ConfigMap", "llama-pd-config"),
    } <= {key for key in base if base[key] != renamed[key]}


def test_draining_annotation_name_is_the_shared_contract():
    assert DRAINING_ANNOTATION == "kvferry.dev/draining"


def test_kvferry_render_prints_valid_yaml(capsys):
    assert kvferry(["render", str(EXAMPLES / "aggregated-pool.yaml"), "--namespace", "prod"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in documents} == {"prod"}
    assert any(d["kind"] == "Deployment" and d["metadata"]["name"] == "smollm-engine" for d in documents)


def test_kvferry_render_names_the_bad_field_without_a_traceback(tmp_path, capsys):
    bad = load_example("aggregated-pool.yaml")
    bad["spec"]["engine"]["blockSize"] = "big"
    bad["spec"]["router"]["colour"] = "blue"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert kvferry(["render", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.engine.blockSize" in err and "spec.router.colour" in err
    assert "Traceback" not in err
    path.write_text("spec: [unclosed")
    assert kvferry(["render", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert kvferry(["render", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _args(manifest: dict) -> list[str]:
    return manifest["spec"]["template"]["spec"]["containers"][0].get("args", [])


def test_salt_from_api_key_reaches_the_router_and_needs_keys():
    body = load_example("disaggregated-pool.yaml")
    body["spec"]["router"]["saltFromApiKey"] = True
    body["spec"]["router"]["apiKeySecretRef"] = {"name": "llm-keys", "key": "keys"}
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    router = next(m for m in rendered if m["kind"] == "Deployment" and _args(m)[:1] == ["router"])
    assert "--salt-from-api-key" in _args(router) and "--api-key-file" in _args(router)
    del body["spec"]["router"]["apiKeySecretRef"]
    with pytest.raises(ValueError, match="saltFromApiKey needs apiKeySecretRef"):
        parse_pool(body)
