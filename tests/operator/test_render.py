"""render: golden output, kubernetes-validate strict for 1.32-1.37, contracts, and `kvferry render`."""

from __future__ import annotations

import copy
import json
import os

import kubernetes_validate
import pytest
import yaml

from pool_operator.images import ImageSet
from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer, manifest_key
from services.cli import main as kvferry
from services.common.hashing import HASH_VERSION
from services.common.pod_labels import APPLIED_HASH_ANNOTATION, DRAINING_ANNOTATION
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
        "--api-key-file",
        "/etc/kvferry/api-key/keys.txt",
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


def test_engine_quantization_reaches_every_engine_and_defaults_to_the_checkpoint():
    body = load_example("disaggregated-pool.yaml")
    default = PoolRenderer(parse_pool(body), IMAGES).render()
    body["spec"]["engine"]["quantization"] = "int8"
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    engines = [m for m in rendered if m["kind"] == "Deployment" and "--role" in _args(m)]
    assert engines and all(_args(m)[_args(m).index("--quantization") + 1] == "int8" for m in engines)
    assert all(
        _args(m)[_args(m).index("--quantization") + 1] == "auto"
        for m in default
        if m["kind"] == "Deployment" and "--role" in _args(m)
    )
    body["spec"]["engine"]["quantization"] = "nf4"
    with pytest.raises(ValueError, match="quantization"):
        parse_pool(body)


def _args(manifest: dict) -> list[str]:
    return manifest["spec"]["template"]["spec"]["containers"][0].get("args", [])


def test_loras_reach_every_engine_and_are_checked():
    body = load_example("disaggregated-pool.yaml")
    body["spec"]["loras"] = [
        {"name": "sql", "source": "adapters/sql"},
        {"name": "chat", "source": "/opt/adapters/chat", "maxRank": 64},
    ]
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    engines = [m for m in rendered if m["kind"] == "Deployment" and "--role" in _args(m)]
    assert len(engines) == 2
    for m in engines:
        args = _args(m)
        assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "64"
        i = args.index("--lora-modules")
        assert args[i + 1 : i + 3] == [
            "sql=/models/llama-3.1-8b-instruct/adapters/sql",
            "chat=/opt/adapters/chat",
        ]
        assert "--enable-lora" in args
    body["spec"]["loras"] = [{"name": "x", "source": "a"}, {"name": "x", "source": "b"}]
    with pytest.raises(ValueError, match="adapter names must be unique"):
        parse_pool(body)
    embed = load_example("embedding-pool.yaml")
    embed["spec"]["loras"] = [{"name": "x", "source": "a"}]
    with pytest.raises(ValueError, match="loras need engine.task generate"):
        parse_pool(embed)


def test_speculative_reaches_decode_engines_only():
    from services.engine.core.spec_config import SpeculativeConfig

    body = load_example("disaggregated-pool.yaml")
    body["spec"]["engine"]["speculative"] = {
        "method": "ngram",
        "numSpeculativeTokens": 4,
        "promptLookupMax": 3,
    }
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    engines = {
        _args(m)[_args(m).index("--role") + 1]: _args(m)
        for m in rendered
        if m["kind"] == "Deployment" and "--role" in _args(m)
    }
    assert "--speculative-config" not in engines["prefill"]  # prefill emits one token: nothing to draft
    args = engines["decode"]
    cfg = SpeculativeConfig.from_json(args[args.index("--speculative-config") + 1])
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 4, 3)
    body["spec"]["engine"]["speculative"] = {
        "method": "draft_model",
        "numSpeculativeTokens": 3,
        "model": "draft",
    }
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    decode = next(_args(m) for m in rendered if m["kind"] == "Deployment" and "decode" in _args(m))
    spec = json.loads(decode[decode.index("--speculative-config") + 1])
    assert spec == {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "model": "/models/llama-3.1-8b-instruct/draft",
    }
    for bad, message in (
        ({"method": "draft_model", "numSpeculativeTokens": 3}, "need model"),
        ({"method": "ngram", "numSpeculativeTokens": 3, "model": "x"}, "ngram takes no model"),
        ({"method": "ngram", "numSpeculativeTokens": 0}, "numSpeculativeTokens"),
    ):
        body["spec"]["engine"]["speculative"] = bad
        with pytest.raises(ValueError, match=message):
            parse_pool(body)


# A non-default, valid value for every EngineSpec field: each must change what the engines run.
_ENGINE_FIELD_VALUES = {
    "image": "registry.example/kvferry-engine:other",
    "dtype": "float32",
    "quantization": "int8",
    "block_size": 32,
    "max_model_len": 2048,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 3000,
    "gpu_memory_utilization": 0.8,
    "tensor_parallel_size": 2,
    "prefix_caching": False,
    "task": "embed",
    "enable_auto_tool_choice": True,
    "tool_call_parser": "hermes",
    "reasoning_parser": "qwen3",
    "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
    "extra_args": ["--seed", "7"],
    "env": [{"name": "FOO", "value": "1"}],
}


def _engines(body: dict) -> list[dict]:
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    return [
        m["spec"]["template"]["spec"] for m in rendered if m["kind"] == "Deployment" and "--role" in _args(m)
    ]


def test_every_engine_field_reaches_the_engines():
    """No silent pool field: setting any spec.engine field changes the engine pods (flags, image, env)."""
    from pool_operator.models import EngineSpec

    assert set(_ENGINE_FIELD_VALUES) == set(EngineSpec.model_fields), "a new engine field needs an entry here"
    base_body = load_example("aggregated-pool.yaml")
    base = _engines(base_body)
    for field, value in _ENGINE_FIELD_VALUES.items():
        if value is None:
            continue
        body = copy.deepcopy(base_body)
        key = EngineSpec.model_fields[field].alias or field
        body["spec"]["engine"][key] = value
        if field == "enable_auto_tool_choice":
            body["spec"]["engine"]["toolCallParser"] = "hermes"
        assert _engines(body) != base, f"spec.engine.{key} reaches nothing"


def test_tensor_parallel_size_sets_the_flag_and_the_gpu_count():
    """--tensor-parallel-size 2 and nvidia.com/gpu 2 on GPU pods (none added to CPU pods); refused where
    the engines cannot shard (P/D, kvstore, LoRA, speculative decoding)."""
    body = load_example("aggregated-pool.yaml")
    body["spec"]["engine"]["tensorParallelSize"] = 2
    (pod,) = _engines(body)
    args = pod["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2"
    cpu = copy.deepcopy(body)
    cpu["spec"]["decode"]["resources"] = {"requests": {"cpu": "4"}}
    assert "nvidia.com/gpu" not in str(_engines(cpu)[0]["containers"][0]["resources"])
    pd = load_example("disaggregated-pool.yaml")
    pd["spec"]["engine"]["tensorParallelSize"] = 2
    with pytest.raises(ValueError, match="tensorParallelSize > 1 needs mode Aggregated"):
        parse_pool(pd)
    spec = copy.deepcopy(body)
    spec["spec"]["engine"]["speculative"] = {"method": "ngram", "numSpeculativeTokens": 3}
    with pytest.raises(ValueError, match="does not run speculative decoding"):
        parse_pool(spec)


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
