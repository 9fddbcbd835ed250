"""Model families beyond the parity matrix: plugins through the kvferry.models entry points, MoE expert
counters on /metrics, sliding-window attention past the window."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.worker.models import get_model_class
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process

PLUGIN = '''
"""A kvferry model plugin: a Llama whose logits always favour token 7 (so its use is visible)."""
import torch
from services.engine.worker.models.llama import LlamaForCausalLM


class SevenLM(LlamaForCausalLM):
    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        logits[:, 7] += 1e4
        return logits
'''


def _install_plugin(site: Path) -> None:
    """What `pip install` leaves in site-packages: the module and a dist-info with the entry point."""
    (site / "kvferry_seven_plugin.py").write_text(PLUGIN)
    info = site / "kvferry_seven_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvferry-seven-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[kvferry.models]\nSevenForCausalLM = kvferry_seven_plugin:SevenLM\n"
    )


def test_a_plugin_architecture_is_served(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="plugins \\(kvferry.models entry points\\): none installed"):
        get_model_class("SevenForCausalLM")
    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site)
    monkeypatch.syspath_prepend(str(site))
    model = tmp_path / "seven"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "architectures": ["SevenForCausalLM"]}))
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == [7] * 5
    with pytest.raises(ValueError, match="plugins \\(kvferry.models entry points\\): SevenForCausalLM"):
        get_model_class("NopeForCausalLM")
    sys.modules.pop("kvferry_seven_plugin", None)


def _expert_counts(url: str) -> dict[tuple[str, str], float]:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = r'kvferry_moe_expert_tokens_total\{expert="(\d+)",layer="(\d+)"\} (\S+)'
    return {(m[2], m[1]): float(m[3]) for m in re.finditer(pattern, metrics)}


def test_moe_expert_tokens_are_counted_on_metrics(family_dir) -> None:
    engine = start_in_process(family_dir("mixtral"), "--num-kv-blocks", "64")
    try:
        before = _expert_counts(engine.url)
        assert len(before) == 2 * 8  # (layer, expert) for two layers of eight experts
        assert all(0 <= v < 1000 for v in before.values())  # from zero (the warm-up's tokens only)
        body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30).status_code == 200
        after = _expert_counts(engine.url)
        for layer in ("0", "1"):  # 37 prompt tokens and 3 decode steps, two experts each
            added = sum(after[(layer, e)] - before[(layer, e)] for e in map(str, range(8)))
            assert added == 2 * (37 + 3)
        assert len({after[("0", e)] for e in map(str, range(8))}) > 1  # routing differs per token
    finally:
        assert engine.stop() == 0


def test_sliding_window_frees_blocks_and_matches_hf_past_the_window(
    family_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phi-3 with a 40-token window, served to its full 1024-token context: a 60-token prompt and 120
    new tokens equal HF's greedy output, and while it decodes the request holds only the blocks its
    window touches (the others go back to the pool)."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import hf_greedy

    phi3 = family_dir("phi3")
    llm = LLM(model=str(phi3), dtype="float32", num_kv_blocks=64)
    assert llm.engine.core.max_model_len == 1024
    kv = llm.engine.core.kv_manager
    most: list[int] = []
    allocate = kv.allocate_slots

    def counting(request, *args, **kwargs):  # noqa: ANN001, ANN202 - wraps the real method
        out = allocate(request, *args, **kwargs)
        if request.num_computed_tokens >= 60:  # decoding: the prompt's blocks were held for its queries
            most.append(sum(1 for i in kv.block_ids(request.request_id) if i >= 0))
        return out

    monkeypatch.setattr(kv, "allocate_slots", counting)
    prompt = [3 + (i * 7) % 90 for i in range(60)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(phi3), dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 120)
    assert most and max(most) <= -(-40 // 16) + 1  # blocks of positions (p-40, p] plus p's own
    assert kv.pool.num_free_blocks == 64


def test_a_draft_model_on_a_window_freeing_target_is_refused(family_dir, llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="frees KV blocks before its sliding window \\(40\\).*'ngram'"):
        LLM(
            model=str(family_dir("phi3")),
            num_kv_blocks=64,
            speculative_config={
                "method": "draft_model",
                "model": str(llama_dir),
                "num_speculative_tokens": 2,
            },
        )


def test_gemma3_options_it_cannot_serve_are_named(family_dir, tmp_path: Path) -> None:
    """Gemma 3 (its parity with HF runs in test_parity): soft-capped attention scores are refused by name."""
    model = tmp_path / "gemma3"
    shutil.copytree(family_dir("gemma3"), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0: soft-capped attention scores"):
        LLM(model=str(model), dtype="float32", num_kv_blocks=64)


def test_gpt_oss_options_it_cannot_serve_are_named(family_dir, tmp_path: Path) -> None:
    """gpt-oss (its parity with HF runs in test_parity): a rotary type without a table here is refused
    naming the field; it declares no tensor-parallel plan or LoRA targets, so both are refused by name."""
    from services.engine.worker.models.capabilities import ModelCapabilities

    model = tmp_path / "gpt_oss"
    shutil.copytree(family_dir("gpt_oss"), model)
    cfg = json.loads((model / "config.json").read_text())
    rope = {**cfg["rope_parameters"], "rope_type": "longrope"}
    (model / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="rope_parameters.rope_type='longrope' is not supported"):
        LLM(model=str(model), dtype="float32", num_kv_blocks=64)
    caps = ModelCapabilities.of(get_model_class("GptOssForCausalLM"))
    assert caps.tp_plan is None and caps.lora is None and caps.pipeline and caps.logits
    with pytest.raises(ValueError, match="GptOssForCausalLM"):
        LLM(model=str(family_dir("gpt_oss")), dtype="float32", num_kv_blocks=64, enable_lora=True)


def test_gpt_oss_norm_rounds_like_hf_in_bf16() -> None:
    """gpt-oss's norms keep an fp32 weight through .to(bf16) and round once after the product, as HF's
    GptOssRMSNorm (kept in fp32) does; Llama's norm rounds before it, which differs in bf16."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm as HFNorm

    from services.engine.worker.attention.torch_backend import TorchBackend
    from services.engine.worker.models.gpt_oss import GptOssRMSNorm

    torch.manual_seed(0)
    weight = torch.randn(64)
    ours, hf = GptOssRMSNorm(64, 1e-5).to(torch.bfloat16), HFNorm(64, 1e-5)
    assert ours.weight.dtype == torch.float32
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    x, residual = torch.randn(9, 64, dtype=torch.bfloat16), torch.randn(9, 64, dtype=torch.bfloat16)
    out, summed = ours(x, TorchBackend(), residual)
    assert torch.equal(summed, x + residual) and torch.equal(out, hf(x + residual))
    llama, _ = TorchBackend.rms_norm(x, weight.to(torch.bfloat16), 1e-5, residual)
    assert not torch.equal(llama, out)


def test_a_released_gpt_oss_config_reads_as_its_architecture() -> None:
    """openai/gpt-oss-20b's config.json (transformers 4.55 style: rope_scaling, MXFP4 experts) gives the
    facts the model is built from (the released checkpoint itself is not run here)."""
    from services.engine.worker.model_config import ModelConfig

    layers = 24
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
            "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
            "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
            "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
            "rope_scaling": {
                "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                "rope_type": "yarn", "truncate": False,
            },
            "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "vocab_size": 201088,
        }
    )  # fmt: skip
    assert (cfg.qkv_bias, cfg.o_bias, cfg.attention_sinks, cfg.mxfp4_experts) == (True, True, True, True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rope_theta) == (7.0, 1.702, 150000)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert [cfg.window_of(i) for i in range(4)] == [128, 0, 128, 0] and cfg.kv_window is None
    assert all(cfg.is_moe_layer(i) for i in range(layers))
    from services.engine.worker.models.gpt_oss import GptOssForCausalLM

    with torch.device("meta"):  # the shapes of the released tensors, nothing allocated
        moe = GptOssForCausalLM(cfg, 4096, torch.bfloat16).layers[0].mlp
    assert moe.w13_blocks.shape == (32, 5760, 90, 16) and moe.w13_scales.shape == (32, 5760, 90)
    assert moe.w2_blocks.shape == (32, 2880, 90, 16) and moe.b13.shape == (32, 5760)
