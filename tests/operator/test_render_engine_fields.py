"""Every spec.engine field reaches the engine pods (flags, image, env): quantization, LoRA adapters,
speculative decoding, tensor parallelism and its GPU count, and the audit that no field is silent."""

from __future__ import annotations

import copy
import json

import pytest

from pool_operator.poolfile import parse_pool
from pool_operator.render import PoolRenderer
from tests.operator.conftest import load_example
from tests.operator.test_render import IMAGES, _args


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
    "drain_seconds": 60,
    "max_model_len": 2048,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 3000,
    "device": "cuda",
    "gpu_memory_utilization": 0.8,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "prefix_caching": False,
    "task": "embed",
    "enable_auto_tool_choice": True,
    "tool_call_parser": "hermes",
    "reasoning_parser": "qwen3",
    "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
    "kv_offload": {"hostMemory": "1Gi"},
    "extra_args": ["--seed", "7"],
    "env": [{"name": "FOO", "value": "1"}],
}


def _engines(body: dict) -> list[dict]:
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    return [
        m["spec"]["template"]["spec"] for m in rendered if m["kind"] == "Deployment" and "--role" in _args(m)
    ]


def test_pipeline_parallel_size_sets_the_flag_and_the_gpu_count():
    """--pipeline-parallel-size 2, and nvidia.com/gpu = tensor x pipeline ranks on GPU pods; refused
    with P/D like tensor parallelism."""
    body = load_example("aggregated-pool.yaml")
    body["spec"]["engine"]["tensorParallelSize"] = 2
    body["spec"]["engine"]["pipelineParallelSize"] = 3
    (pod,) = _engines(body)
    args = pod["containers"][0]["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "3"
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "6"
    pd = load_example("disaggregated-pool.yaml")
    pd["spec"]["engine"]["pipelineParallelSize"] = 2
    with pytest.raises(ValueError, match="pipelineParallelSize > 1 needs no kvstore and no loras"):
        parse_pool(pd)
    pd["spec"]["kvstore"] = {"enabled": False}  # P/D over pipeline stages: rank r reads rank r
    pods = _engines(pd)
    assert len(pods) == 2 and all("--pipeline-parallel-size" in p["containers"][0]["args"] for p in pods)


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
    """--tensor-parallel-size 2 and nvidia.com/gpu 2 on GPU pods (none added to CPU pods), with the kvstore,
    LoRA and EAGLE; P/D over pipeline stages; refused where the engines cannot shard (the kvstore, LoRA
    or speculation over pipeline stages)."""
    body = load_example("aggregated-pool.yaml")
    body["spec"]["engine"]["tensorParallelSize"] = 2
    (pod,) = _engines(body)
    args = pod["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2"
    cpu = copy.deepcopy(body)
    cpu["spec"]["decode"]["resources"] = {"requests": {"cpu": "4"}}
    with pytest.raises(
        ValueError, match="need GPUs: name nvidia.com/gpu"
    ):  # a TP pool on CPU nodes by mistake
        parse_pool(cpu)
    cpu["spec"]["engine"]["device"] = "cpu"  # on purpose: CPU tensor parallelism (gloo)
    (cpu_pod,) = _engines(cpu)
    assert "nvidia.com/gpu" not in str(cpu_pod["containers"][0]["resources"])
    cpu_args = cpu_pod["containers"][0]["args"]
    assert cpu_args[cpu_args.index("--device") + 1] == "cpu"
    pd = load_example("disaggregated-pool.yaml")
    pd["spec"]["engine"]["tensorParallelSize"] = 2  # one engine spec: prefill and decode shard alike
    pods = _engines(pd)  # with the kvstore tier: the ranks' shards move as whole blocks
    assert len(pods) == 2 and all("--kvstore-url" in p["containers"][0]["args"] for p in pods)
    for pod in pods:
        args = pod["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
    pd["spec"]["engine"]["pipelineParallelSize"] = 2
    with pytest.raises(ValueError, match="pipelineParallelSize > 1 needs no kvstore and no loras"):
        parse_pool(pd)
    pd["spec"]["kvstore"] = {"enabled": False}  # P/D over pipeline stages: rank r reads rank r
    pods = _engines(pd)
    assert len(pods) == 2 and all("--pipeline-parallel-size" in p["containers"][0]["args"] for p in pods)
    spec = copy.deepcopy(body)
    spec["spec"]["engine"]["speculative"] = {"method": "ngram", "numSpeculativeTokens": 3}
    (spec_pod,) = _engines(spec)  # n-gram (and draft-model) speculation run with TP
    assert "--speculative-config" in spec_pod["containers"][0]["args"]
    spec["spec"]["engine"]["speculative"] = {"method": "eagle", "numSpeculativeTokens": 3, "model": "eagle"}
    (eagle_pod,) = _engines(spec)  # EAGLE's head reads whole copies of the embedding and LM head
    assert "eagle" in str(eagle_pod["containers"][0]["args"])
    spec["spec"]["engine"] |= {"tensorParallelSize": 1, "pipelineParallelSize": 2}
    with pytest.raises(ValueError, match="pipelineParallelSize > 1 does not run speculative decoding"):
        parse_pool(spec)


def _router_args(body: dict) -> list[str]:
    rendered = PoolRenderer(parse_pool(body), IMAGES).render()
    (router,) = [
        m for m in rendered if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-router")
    ]
    return _args(router)


def test_router_session_affinity_and_the_responses_key():
    """spec.router.sessionAffinity reaches every router as its session flags; stored /v1/responses bodies
    are always sealed with the pool Secret the routers mount."""
    body = load_example("aggregated-pool.yaml")
    args = _router_args(body)
    assert args[args.index("--responses-key-file") + 1] == "/etc/kvferry/pool-secret/token"
    assert "--session-affinity" not in args
    body["spec"]["router"]["sessionAffinity"] = {"stickyLimitTokens": 8192}
    args = _router_args(body)
    assert "--session-affinity" in args and args[args.index("--sticky-limit") + 1] == "8192"
    assert args[args.index("--session-ttl") + 1] == "1800"


def test_kv_offload_tiers_reach_the_engines() -> None:
    """spec.engine.kvOffload: the host tier's bytes on every engine, the disk tier on an emptyDir of its size."""
    body = load_example("aggregated-pool.yaml")
    body["spec"]["engine"]["kvOffload"] = {"hostMemory": "2Gi", "disk": "20Gi", "policy": "ARC"}
    (pod,) = _engines(body)
    args = pod["containers"][0]["args"]
    assert args[args.index("--kv-offload-policy") + 1] == "arc"
    assert args[args.index("--kv-offload-cpu-bytes") + 1] == str(2 * 2**30)
    assert args[args.index("--kv-offload-disk-bytes") + 1] == str(20 * 2**30)
    path = args[args.index("--kv-offload-disk-path") + 1]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["kv-offload"] == path
    assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "20Gi"}} in pod["volumes"]
    body["spec"]["engine"]["kvOffload"] = {"disk": "20Gi"}
    with pytest.raises(ValueError, match="kvOffload.disk holds what the host tier evicts"):
        parse_pool(body)
    body["spec"]["engine"]["kvOffload"] = {"policy": "ARC"}
    with pytest.raises(ValueError, match="kvOffload.policy is the host tier's eviction policy"):
        parse_pool(body)
    body["spec"]["engine"] |= {"kvOffload": {"hostMemory": "1Gi"}, "tensorParallelSize": 2, "device": "cpu"}
    with pytest.raises(ValueError, match="kvOffload does not run with tensor or pipeline parallelism"):
        parse_pool(body)


def test_drain_seconds_sets_the_drain_and_the_grace_period_together():
    body = load_example("disaggregated-pool.yaml")
    default = [m for m in PoolRenderer(parse_pool(body), IMAGES).render() if _is_engine(m)]
    assert default and all("--drain-timeout" not in _args(m) for m in default)
    assert all(m["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120 for m in default)
    body["spec"]["engine"]["drainSeconds"] = 90
    engines = [m for m in PoolRenderer(parse_pool(body), IMAGES).render() if _is_engine(m)]
    assert len(engines) == 2
    for m in engines:
        args = _args(m)
        assert args[args.index("--drain-timeout") + 1] == "90"
        assert m["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 240
    body["spec"]["engine"]["drainSeconds"] = 0
    with pytest.raises(ValueError, match="drainSeconds"):
        parse_pool(body)


def _is_engine(manifest: dict) -> bool:
    return manifest["kind"] == "Deployment" and "--role" in _args(manifest)
