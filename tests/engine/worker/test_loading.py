"""Weights and architectures: GGUF (quantized) and sharded safetensors load correctly; clear errors otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from tests.checkpoints import hf_greedy
from tests.gguf_writer import quantize_roundtrip, write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 60)), [42]]


@pytest.fixture(scope="module")
def gguf_file(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4.gguf")


def test_quantized_gguf_matches_hf_on_dequantized_weights(
    llama_dir: Path, gguf_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(quantize_roundtrip(name, p.numpy())))
    # plain rope in GGUF metadata: give the HF model the same (drop llama3 scaling)
    cfg = json.loads((llama_dir / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    plain = type(hf.config)(
        **{**hf.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    )
    ref = type(hf)(plain).eval()
    ref.load_state_dict(hf.state_dict())
    llm = LLM(model=str(gguf_file), dtype="float32", num_kv_blocks=64, kv_cache_memory_gb=None)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt)


def test_gguf_tokenizer_and_chat_template_come_from_metadata(llama_dir: Path, gguf_file: Path) -> None:
    llm = LLM(model=str(gguf_file), dtype="float32", num_kv_blocks=64)
    original = Tokenizer(llama_dir)
    text = "the quick brown fox über 東京 🚀 0123"
    assert llm.tokenizer.encode(text) == original.encode(text)
    msgs = [{"role": "user", "content": "hello"}]
    assert llm.tokenizer.encode_chat(msgs) == original.encode_chat(msgs)
    assert llm.tokenizer.eos_token_id == original.eos_token_id


def test_sharded_safetensors_and_mistral(mistral_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(mistral_dir, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    hf = AutoModelForCausalLM.from_pretrained(str(mistral_dir), dtype=torch.float32).eval()
    outs = LLM(model=str(sharded), dtype="float32", num_kv_blocks=64).generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)


def test_unknown_architecture_lists_supported(llama_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match="GPTNeoXForCausalLM.*supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Gemma3ForCausalLM, "
        "GptOssForCausalLM, Idefics3ForConditionalGeneration, LlamaForCausalLM, "
        "LlavaForConditionalGeneration, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM",
    ):
        LLM(model=str(bad), dtype="float32", num_kv_blocks=16)


def test_missing_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), dtype="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(llama_dir: Path, dtype: str) -> None:
    fp32 = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64).generate(PROMPTS, GREEDY)
    half = LLM(model=str(llama_dir), num_kv_blocks=64, dtype=dtype).generate(PROMPTS, GREEDY)
    assert half[0].outputs[0].token_ids[:3] == fp32[0].outputs[0].token_ids[:3]


def test_pipeline_parallel_size_past_the_layers_is_refused_by_name(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's num_hidden_layers=2"):
        LLM(model=str(llama_dir), pipeline_parallel_size=4)


def test_gpu_memory_utilization_on_a_cpu_engine_says_it_does_not_apply(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(llama_dir), dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=2)
    assert "gpu_memory_utilization applies to GPU engines" in caplog.text
    assert llm.engine.core.num_blocks > 0
