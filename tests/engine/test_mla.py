"""DeepSeek-V3's multi-head latent attention: a token's cached KV is its latent ([c_kv | k_pe] per layer),
the other MLA variant (plain q_proj, no interleave) equals HF, and unsupported config fields are named."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.worker.model_config import ModelConfig
from tests.checkpoints import build_checkpoint, hf_greedy


@pytest.fixture(scope="module")
def plain_mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-deepseek-plain"), "deepseek_v3_plain")


def test_kv_bytes_per_token_is_the_latent(
    family_dir, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes in fp32, against Llama's 2 x kv heads x head_dim;
    the engine's start-up line says it."""
    path = family_dir("deepseek_v3")
    cfg = json.loads((path / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="services.engine.engine_core"):
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    stats = llm.worker_stats()
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert stats.kv_bytes_per_token == latent * cfg["num_hidden_layers"] * 4
    assert f"({stats.kv_bytes_per_token} KV bytes per token)" in caplog.text
    assert stats.kv_cache_shape[1:] == (cfg["num_hidden_layers"], 2, 16, 1, latent // 2)
    llama_cfg = json.loads((llama_dir / "config.json").read_text())
    llama = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64).worker_stats()
    head_dim = llama_cfg["hidden_size"] // llama_cfg["num_attention_heads"]
    per_layer = 2 * llama_cfg["num_key_value_heads"] * head_dim * 4
    assert llama.kv_bytes_per_token == per_layer * llama_cfg["num_hidden_layers"]


def _matches_hf(path: Path) -> None:
    """Greedy tokens of a few prompts (chunked prefill) equal HF's, in fp32."""
    from transformers import AutoModelForCausalLM

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 33, 70)]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


def test_plain_query_mla_matches_hf(plain_mla_dir: Path) -> None:
    """No q LoRA, rotary pairs in rotate-half order, v_head_dim != qk_nope_head_dim, ungrouped routing."""
    _matches_hf(plain_mla_dir)


def test_deepseek_v2_matches_hf(tmp_path: Path) -> None:
    """DeepSeek-V2: the same MLA, softmax routing limited to the best groups (group_limited_greedy)."""
    _matches_hf(build_checkpoint(tmp_path, "deepseek_v2"))


_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "kv_lora_rank": 16, "q_lora_rank": None,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"kv_lora_rank": 15}, "kv_lora_rank"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ],
)
def test_unsupported_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**_V3, **change})


def test_v3_config_reads_as_latent_cache_facts() -> None:
    cfg = ModelConfig.from_hf_dict({**_V3, "first_k_dense_replace": 1})
    assert cfg.mla is not None and cfg.mla.latent_size == 24
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 12)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]


_RELEASED = {  # deepseek-ai/DeepSeek-V3's config.json, the fields that shape the model
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip


def test_the_released_deepseek_v3_config() -> None:
    """Its FP8 checkpoint is refused naming quantization_config; its bf16 twin's config builds (on meta) the
    released tensor shapes, caches 70,272 bytes per token in bf16, and scales scores as HF does."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from services.engine.worker.model_runner import bytes_per_block
    from services.engine.worker.models import get_model_class
    from services.engine.worker.models.capabilities import ModelCapabilities
    from services.engine.worker.models.deepseek_v3 import DeepseekV3ForCausalLM, softmax_scale

    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_hf_dict(_RELEASED)
    bf16 = {k: v for k, v in _RELEASED.items() if k != "quantization_config"}
    cfg = ModelConfig.from_hf_dict(bf16)
    assert bytes_per_block(cfg, 1, torch.bfloat16) == 61 * (512 + 64) * 2 == 70272
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, 4096, torch.bfloat16)
    dense, moe = model.layers[2], model.layers[3]
    attn = moe.self_attn
    assert attn.q_b_proj.weight.shape == (128 * 192, 1536) and attn.kv_b_proj.weight.shape == (128 * 256, 512)
    assert attn.kv_a_proj_with_mqa.weight.shape == (576, 7168) and attn.o_proj.weight.shape == (
        7168,
        128 * 128,
    )
    assert dense.mlp.gate_up_proj.weight.shape == (2 * 18432, 7168)
    assert moe.mlp.w13.shape == (256, 4096, 7168) and moe.mlp.shared_experts.down_proj.weight.shape == (
        7168,
        2048,
    )
    hf_cfg = DeepseekV3Config(**{**bf16, "rope_scaling": {**bf16["rope_scaling"], "mscale_all_dim": 0.8}})
    ours = softmax_scale(cfg.model_copy(update={"rope_scaling": {**cfg.rope_scaling, "mscale_all_dim": 0.8}}))
    assert ours == pytest.approx(yarn_apply_mscale(hf_cfg.rope_parameters, 192**-0.5), rel=1e-12)
    caps = ModelCapabilities.of(get_model_class("DeepseekV3ForCausalLM"))
    assert caps.tp_plan is None and caps.lora is None and not caps.pipeline and caps.logits


def test_yarn_table_with_deepseek_mscales_equals_hf() -> None:
    """cos / sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim), as HF's rotary embedding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from kvkernels.reference import build_cos_sin_cache
    from services.engine.worker.rope import rope_rows

    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    }  # fmt: skip
    hf = DeepseekV3RotaryEmbedding(DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rope))
    positions = torch.arange(0, 160000, 997)
    cos, sin = hf(torch.zeros(1), positions[None])
    ours_cos, ours_sin = rope_rows(positions, build_cos_sin_cache(64, 160000, 10000.0, rope))
    assert hf.attention_scaling != 1.0
    torch.testing.assert_close(ours_cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_sin, sin[0], rtol=1e-5, atol=1e-5)


def test_int8_experts_compute_their_dequantized_twin() -> None:
    """--quantization int8 holds DeepSeek's experts as int8 codes with a scale per (expert, row): the layer
    equals the float layer holding codes x scales (the scales reach the fused MoE op)."""
    import copy

    from services.engine.worker.attention.torch_backend import TorchBackend
    from services.engine.worker.models.deepseek_moe import DeepseekMoE

    cfg = ModelConfig.from_hf_dict({**_V3, "n_shared_experts": 1})
    torch.manual_seed(0)
    floats = DeepseekMoE(cfg)
    for p in floats.parameters():
        p.data.normal_(0.0, 0.2)
    int8 = copy.deepcopy(floats)
    int8.quantize_int8()
    assert int8.w13.dtype == torch.int8 and int8.w13_scale is not None and int8.w2_scale is not None
    floats.w13.data = int8.w13.float() * int8.w13_scale[..., None]
    floats.w2.data = int8.w2.float() * int8.w2_scale[..., None]
    x = torch.randn(7, cfg.hidden_size)
    torch.testing.assert_close(int8(x, TorchBackend()), floats(x, TorchBackend()), rtol=1e-5, atol=1e-5)
    assert int8.expert_tokens.sum() == 7 * cfg.num_experts_per_tok


@pytest.mark.parametrize(
    ("change", "field"),
    [({"norm_topk_prob": True}, "norm_topk_prob"), ({"topk_method": "noaux_tc"}, "topk_method")],
)
def test_unsupported_v2_config_names_the_field(change: dict, field: str) -> None:
    v2 = {**_V3, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "group_limited_greedy"}
    assert ModelConfig.from_hf_dict(v2).mla is not None
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**v2, **change})
