"""gpt-oss MXFP4 experts (blocks + scales, as real gpt-oss checkpoints store them): kept packed in memory,
decoded in the MoE path to exactly their dequantized twin; greedy tokens equal HF reading the same
checkpoint (dequantized at load)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine import LLM, SamplingParams
from services.engine.worker.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.checkpoints import hf_greedy
from tests.quant_writers import write_mxfp4_experts

PROMPTS = [[5, 9, 13, 200, 7], [3 + (i * 7) % 90 for i in range(60)], [42]]


def test_mxfp4_codes_decode_like_hf() -> None:
    """Every code and a spread of scales decode as HF transformers' MXFP4 conversion does."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 2, 16)  # every byte: both nibbles
    scales = torch.tensor([[[100, 127], [128, 140], [0, 254], [120, 131]]] * 2, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    weight = torch.randn(3, 5, 64)
    again = dequantize_mxfp4(*quantize_mxfp4(weight), torch.float32)
    assert 0 < (again - weight).norm() < 0.2 * weight.norm()  # 4-bit codes: close, not equal


def test_mxfp4_experts_stay_packed_and_match_hf(family_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = tmp_path / "gpt_oss_mxfp4"
    twin = write_mxfp4_experts(family_dir("gpt_oss"), path)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    for i, layer in enumerate(llm.engine.core.runner.model.layers):
        moe = layer.mlp
        floats = [n for n, p in moe.named_parameters() if p.is_floating_point() and p.dim() == 3]
        assert moe.packed and moe.w13_blocks.dtype == torch.uint8 and floats == []  # no float expert copy
        for e in range(moe.num_experts):
            w13, w2 = moe.expert_weights(e)
            assert torch.equal(w13, twin[f"model.layers.{i}.mlp.experts.gate_up_proj"][e].T)
            assert torch.equal(w2, twin[f"model.layers.{i}.mlp.experts.down_proj"][e].T)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.engine.core.moe_expert_tokens()
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    after = llm.engine.core.moe_expert_tokens()
    fed = sum(len(p) for p in PROMPTS) + 11 * len(PROMPTS)  # prompts, then all but the last token sampled
    assert [layer for layer, _ in after] == [0, 1]  # the expert counters of /metrics cover gpt-oss
    for (_, old), (_, new) in zip(before, after, strict=True):
        assert sum(new) - sum(old) == 2 * fed  # top-2
