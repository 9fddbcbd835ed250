"""DeepSeek-V3's multi-head latent attention: a token's cached KV is its latent ([c_kv | k_pe] per layer),
the other MLA variant (plain q_proj, no interleave) equals HF, and unsupported config fields are named."""

from __future__ import annotations

import json
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


def test_kv_bytes_per_token_is_the_latent(family_dir, llama_dir: Path) -> None:
    """(kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes in fp32, against Llama's 2 x kv heads x head_dim."""
    path = family_dir("deepseek_v3")
    cfg = json.loads((path / "config.json").read_text())
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    stats = llm.worker_stats()
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert stats.kv_bytes_per_token == latent * cfg["num_hidden_layers"] * 4
    assert stats.kv_cache_shape[1:] == (cfg["num_hidden_layers"], 2, 16, 1, latent // 2)
    llama_cfg = json.loads((llama_dir / "config.json").read_text())
    llama = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64).worker_stats()
    head_dim = llama_cfg["hidden_size"] // llama_cfg["num_attention_heads"]
    per_layer = 2 * llama_cfg["num_key_value_heads"] * head_dim * 4
    assert llama.kv_bytes_per_token == per_layer * llama_cfg["num_hidden_layers"]


def test_plain_query_mla_matches_hf(plain_mla_dir: Path) -> None:
    """No q LoRA, rotary pairs in rotate-half order, v_head_dim != qk_nope_head_dim, ungrouped routing."""
    from transformers import AutoModelForCausalLM

    vocab = json.loads((plain_mla_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 33, 70)]
    model = AutoModelForCausalLM.from_pretrained(str(plain_mla_dir), dtype=torch.float32).eval()
    llm = LLM(model=str(plain_mla_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


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
