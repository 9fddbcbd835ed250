"""Quantized engines end to end: greedy tokens equal HF on the same dequantized weights; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.checkpoints import hf_greedy
from tests.gguf_writer import quantize_roundtrip, write_gguf
from tests.quant_writers import LINEARS, hf_twin, write_quantized

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 60)), [42]]
ALL_4BIT = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "output": "Q4_1",
    "token_embd": "Q8_0",
}


def _assert_same_greedy(llm: LLM, hf) -> None:
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)


def _quant(llm: LLM) -> str:
    return llm.engine.core.quant.describe()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_checkpoint_matches_its_dequantized_twin(
    mistral_dir: Path, tmp_path: Path, act_order: bool
) -> None:
    twin = write_quantized(mistral_dir, tmp_path / "gptq", "gptq", bits=4, group=32, act_order=act_order)
    llm = LLM(model=str(tmp_path / "gptq"), dtype="float32", num_kv_blocks=64)
    assert _quant(llm).startswith("gptq(4-bit, group 32")
    _assert_same_greedy(llm, hf_twin(mistral_dir, twin))


def test_awq_checkpoint_with_bias_and_tied_head_matches_its_twin(qwen2_dir: Path, tmp_path: Path) -> None:
    twin = write_quantized(qwen2_dir, tmp_path / "awq", "awq", bits=4, group=32)
    llm = LLM(model=str(tmp_path / "awq"), dtype="float32", num_kv_blocks=64)
    assert _quant(llm) == "awq(4-bit, group 32)"
    _assert_same_greedy(llm, hf_twin(qwen2_dir, twin))


def test_gguf_4bit_blocks_run_as_int4_and_match_hf(llama_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(llama_dir, tmp_path / "q4.gguf", ALL_4BIT)
    llm = LLM(model=str(gguf), dtype="float32", num_kv_blocks=64)
    assert "Q4_0" in _quant(llm) and "Q4_1" in _quant(llm)
    kinds = llm.worker_stats().layer_kinds
    assert "Int4Linear" in kinds and "Linear" not in kinds and "PackedLinear" not in kinds
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    twin = {
        n: torch.from_numpy(quantize_roundtrip(n, p.detach().numpy(), ALL_4BIT))
        for n, p in hf.named_parameters()
    }
    plain = type(hf.config)(
        **{**hf.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    )
    ref = type(hf)(plain).eval()
    ref.load_state_dict(twin, strict=False)
    _assert_same_greedy(llm, ref)


def _int8(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)  # all-zero rows (padding) stay zero
    return (w / scale).round().clamp(-127, 127) * scale


def _uint8_minmax(w: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' int8 at load: asymmetric 8-bit codes, one (scale, min) per row."""
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = ((hi - lo) / 255).clamp_min(1e-12)
    return ((w - lo) / scale).round().clamp(0, 255) * scale + lo


def _int4_minmax(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    scale = (hi - lo) / 15
    return (((g - lo) / scale).round().clamp(0, 15) * scale + lo).reshape(w.shape)


def test_int8_at_load_with_tied_head_matches_hf_on_int8_weights(qwen2_dir: Path) -> None:
    llm = LLM(model=str(qwen2_dir), dtype="float32", quantization="int8", num_kv_blocks=64)
    model = llm.engine.core.runner.model
    assert (
        type(model.embed_tokens).__name__ == "Int8Embedding" and type(model.lm_head).__name__ == "Int8Linear"
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if (
                name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS
            ) or name == "model.embed_tokens.weight":
                p.copy_(_int8(p))  # tied: lm_head is the same tensor
    _assert_same_greedy(llm, hf)


def test_int4_at_load_matches_hf_on_group_quantized_weights(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", quantization="int4", num_kv_blocks=64)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                p.copy_(_int4_minmax(p))
            elif name == "lm_head.weight":
                p.copy_(_int8(p))  # int4 keeps the output layer at int8
    _assert_same_greedy(llm, hf)
    bf16 = LLM(model=str(llama_dir), dtype="bfloat16", quantization="none", num_kv_blocks=64)
    q4 = LLM(model=str(llama_dir), dtype="bfloat16", quantization="int4", num_kv_blocks=64)
    ratio = q4.worker_stats().weight_bytes / bf16.worker_stats().weight_bytes
    assert ratio < 0.6, ratio  # the tiny model's embedding stays bf16


def _set_qc(folder: Path, qc: dict) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("qc", "words"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq 3-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv layout"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ],
)
def test_unsupported_checkpoint_quantization_is_a_clear_error(
    llama_dir: Path, tmp_path: Path, qc: dict, words: str
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(llama_dir, folder)
    _set_qc(folder, qc)
    with pytest.raises(ValueError, match="not supported; supported: GGUF") as err:
        LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert words in str(err.value)


def test_unsupported_gguf_tensor_type_is_named(llama_dir: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(
        "blk.0.attn_q.weight", np.zeros((64, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from services.engine.worker.quantization.quant_config import detect

    with pytest.raises(ValueError, match="Q2_K in q2k.gguf are not supported; supported: GGUF Q4_0"):
        detect(path)


@pytest.mark.parametrize(
    ("flag", "match"),
    [("fp8", "is gptq"), ("int8", "already gptq"), ("awq", "is gptq")],
)
def test_quantization_flag_conflicts_are_clear_errors(
    mistral_dir: Path, tmp_path: Path, flag: str, match: str
) -> None:
    write_quantized(mistral_dir, tmp_path / "gptq", "gptq")
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tmp_path / "gptq"), dtype="float32", quantization=flag, num_kv_blocks=64)


def test_quantization_none_dequantizes_a_gptq_checkpoint(mistral_dir: Path, tmp_path: Path) -> None:
    twin = write_quantized(mistral_dir, tmp_path / "gptq", "gptq", act_order=True)
    llm = LLM(model=str(tmp_path / "gptq"), dtype="float32", quantization="none", num_kv_blocks=64)
    assert _quant(llm) == "none"
    _assert_same_greedy(llm, hf_twin(mistral_dir, twin))


@pytest.mark.parametrize(("method", "bits", "kind"), [("gptq", 8, "mistral"), ("awq", 4, "qwen2")])
def test_triton_quantized_layers_match_the_twin_interpreted(
    method: str, bits: int, kind: str, mistral_dir: Path, qwen2_dir: Path, tmp_path: Path
) -> None:
    """The GPU kernel set (Triton attention + dequant GEMM), run by Triton's interpreter on CPU.

    8-bit GPTQ keeps its group-wise codes here (the CPU layers requantize them per channel).
    """
    src = mistral_dir if kind == "mistral" else qwen2_dir
    twin = write_quantized(src, tmp_path / method, method, bits=bits, group=32, act_order=method == "gptq")
    llm = LLM(model=str(tmp_path / method), dtype="float32", attention_backend="triton", num_kv_blocks=64)
    kinds = llm.worker_stats().layer_kinds
    assert "TritonQuantLinear" in kinds and "Int4Linear" not in kinds and "Int8Linear" not in kinds
    _assert_same_greedy(llm, hf_twin(src, twin))


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_on_triton_matches_its_twin_interpreted(
    scheme: str, mistral_dir: Path, tmp_path: Path
) -> None:
    """FP8 E4M3 weights read in the GEMM (decoded exactly), per-tensor / per-channel / 32x32-block scales."""
    from tests.quant_writers import write_fp8

    twin = write_fp8(mistral_dir, tmp_path / "fp8", scheme)
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", attention_backend="triton", num_kv_blocks=64)
    assert _quant(llm).startswith("fp8(")
    layers = [m for m in llm.engine.core.runner.model.modules() if type(m).__name__ == "TritonQuantLinear"]
    assert layers and all(m.fp8 for m in layers)
    _assert_same_greedy(llm, hf_twin(mistral_dir, twin))


def test_fp8_checkpoint_runs_as_int8_on_cpu(mistral_dir: Path, tmp_path: Path) -> None:
    from tests.quant_writers import write_fp8

    twin = write_fp8(mistral_dir, tmp_path / "fp8", "channel")
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=64)
    kinds = llm.worker_stats().layer_kinds
    assert "Int8Linear" in kinds and kinds & {"Linear", "PackedLinear"}  # lm_head stays float, as in vLLM
    _assert_same_greedy(llm, hf_twin(mistral_dir, twin))  # int8 per row is finer than the FP8 codes


def test_fp8_at_load_is_for_gpus(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="fp8 at load is for GPUs"):
        LLM(model=str(llama_dir), dtype="float32", quantization="fp8", num_kv_blocks=64)
    llm = LLM(
        model=str(llama_dir),
        dtype="float32",
        quantization="fp8",
        attention_backend="triton",
        num_kv_blocks=64,
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in (*LINEARS, "lm_head"):
                scale = p.abs().amax(1, keepdim=True) / 448
                p.copy_((p / scale).to(torch.float8_e4m3fn).float() * scale)
    _assert_same_greedy(llm, hf)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_int8_at_load_quantizes_moe_experts_and_matches_hf(family_dir, backend: str) -> None:
    """A tiny Mixtral with --quantization int8: attention linears, head and the stacked experts int8
    (a scale per expert and output row); greedy tokens equal HF's on the same dequantized weights, on
    the CPU kernels and on the Triton ones (interpreted here: the fused MoE kernel reads the codes)."""
    model_dir = family_dir("mixtral")
    float_llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        quantization="int8",
        num_kv_blocks=64,
        attention_backend=backend,
    )
    block = llm.engine.core.runner.model.layers[0].mlp
    assert block.w13.dtype == torch.int8 and block.w2_scale.shape == block.w2.shape[:2]
    assert llm.worker_stats().weight_bytes < 0.4 * float_llm.worker_stats().weight_bytes
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
            if leaf in (*LINEARS, "lm_head") and name.endswith(".weight"):  # Triton's are min/max per row
                p.copy_(_int8(p) if backend == "cpu" else _uint8_minmax(p))
            elif leaf in ("gate_up_proj", "down_proj"):  # stacked experts [E, N, K]: per (expert, row)
                p.copy_(torch.stack([_int8(w) for w in p]))
    _assert_same_greedy(llm, hf)
