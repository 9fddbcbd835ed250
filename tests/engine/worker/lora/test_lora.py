"""Multi-LoRA: a mixed batch of base-model and adapter requests equals HF PEFT request by request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.checkpoints import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 60)), [42, 43], list(range(100, 130)), [7, 7, 7, 8]]
ADAPTERS = {  # name: (rank, alpha, target modules, rsLoRA)
    "a": (8, 16, ["q_proj", "v_proj"], False),
    "b": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "c": (16, 8, ["gate_proj", "down_proj"], False),
    "d": (8, 16, ["embed_tokens", "lm_head", "q_proj", "down_proj"], False),  # PEFT's embedding LoRA too
}


def _write_adapter(
    base_dir: Path, out: Path, seed: int, rank: int, alpha: int, targets: list[str], rs: bool
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rs)
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # random A and B of a size that changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {n: _write_adapter(llama_dir, root / n, i, *spec) for i, (n, spec) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def peft_greedy(llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out: dict[str | None, list[list[int]]] = {}
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    out[None] = [hf_greedy(base, p, 10) for p in PROMPTS]
    for name, path in adapters.items():
        fresh = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
        model = PeftModel.from_pretrained(fresh, str(path)).eval()
        out[name] = [hf_greedy(model, p, 10) for p in PROMPTS]
    return out


def _engine(llama_dir: Path, adapters: dict[str, Path], **kw) -> LLM:
    settings = dict(num_kv_blocks=128, enable_lora=True, max_lora_rank=16) | kw
    return LLM(
        model=str(llama_dir),
        dtype="float32",
        lora_modules={n: str(p) for n, p in adapters.items()},
        **settings,
    )


@pytest.mark.parametrize("blocks", [128, 12])  # 12 blocks of 16 tokens for 20 requests: preemptions
def test_mixed_batch_equals_peft_per_request(
    llama_dir: Path, adapters: dict, peft_greedy: dict, blocks: int
) -> None:
    llm = _engine(llama_dir, adapters, max_loras=3, max_num_batched_tokens=40, num_kv_blocks=blocks)
    names = [None, "a", "b", "c"]
    jobs = [(p, names[(i + j) % 4]) for i, p in enumerate(PROMPTS) for j in range(4)]
    outs = llm.generate([p for p, _ in jobs], GREEDY, lora_name=[n for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy[name][PROMPTS.index(prompt)], (name, prompt)
    assert peft_greedy["a"] != peft_greedy[None]  # the adapters matter
    assert (llm.engine.core.scheduler.num_preemptions > 0) == (blocks == 12)


def test_lm_head_and_embedding_adapters_equal_peft(
    llama_dir: Path, adapters: dict, peft_greedy: dict
) -> None:
    """An adapter on embed_tokens (A indexed by token id) and lm_head, in mixed steps with the base model
    and another adapter, chunked (the logits rows are a subset of the step's rows)."""
    llm = _engine(llama_dir, adapters, max_loras=2, max_num_batched_tokens=40)
    names = [None, "d", "a", "d"]
    jobs = [(p, names[(i + j) % 4]) for i, p in enumerate(PROMPTS) for j in range(4)]
    outs = llm.generate([p for p, _ in jobs], GREEDY, lora_name=[n for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy[name][PROMPTS.index(prompt)], (name, prompt)
    assert peft_greedy["d"] != peft_greedy[None]
    head = llm.engine.core.lora.layers["lm_head"]
    assert head.b is not None and head.b.abs().sum() > 0  # lm_head's LoRA was loaded and used


def test_more_adapters_than_slots_all_finish_with_the_same_tokens(
    llama_dir: Path, adapters: dict, peft_greedy: dict
) -> None:
    llm = _engine(llama_dir, adapters, max_loras=1, max_cpu_loras=1)
    names = ["a", "b", "c", None, "b", "a"]
    outs = llm.generate(PROMPTS[:1] * len(names), GREEDY, lora_name=names)
    assert [o.outputs[0].token_ids for o in outs] == [peft_greedy[n][0] for n in names]
    assert llm.engine.core.lora.evictions >= 2


def test_prefix_cache_is_per_adapter(llama_dir: Path, adapters: dict, peft_greedy: dict) -> None:
    llm = _engine(llama_dir, adapters, max_loras=2)
    prompt = PROMPTS[1]  # 57 tokens: 3 full blocks to share, if it were wrong
    first = llm.generate([prompt], GREEDY, lora_name="a")[0]
    second = llm.generate([prompt], GREEDY, lora_name="b")[0]
    again = llm.generate([prompt], GREEDY, lora_name="a")[0]
    assert second.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == peft_greedy["a"][1]
    assert second.outputs[0].token_ids == peft_greedy["b"][1]


def test_lora_errors_name_the_problem(llama_dir: Path, adapters: dict, tmp_path: Path) -> None:
    llm = _engine(llama_dir, {"a": adapters["a"]})
    with pytest.raises(LookupError, match="LoRA adapter 'zz' is not loaded"):
        llm.generate([[1, 2]], GREEDY, lora_name="zz")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        llm.engine.core.lora.add("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "trainable_token_indices": [3, 4]}))
    with pytest.raises(ValueError, match="trainable_token_indices=\\[3, 4\\] is not supported"):
        llm.engine.core.lora.add("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    with pytest.raises(ValueError, match="r=64 is outside 1..max_lora_rank=16"):
        llm.engine.core.lora.add("bad", str(bad))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapters["d"] / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
    tensors[key] = torch.cat([tensors[key], tensors[key][:8]])  # 8 added tokens
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text((adapters["d"] / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="embed_tokens.base_layer.weight has shape .* extended or resized"):
        llm.engine.core.lora.add("bad", str(bad))
    with pytest.raises(ValueError, match="need enable_lora"):
        LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64, lora_modules={"a": str(adapters["a"])})
    assert llm.generate([[1, 2]], GREEDY, lora_name="a")[0].outputs[0].token_ids  # still serving


def test_unload_while_running_lets_the_running_request_finish(
    llama_dir: Path, adapters: dict, peft_greedy: dict
) -> None:
    llm = _engine(llama_dir, adapters, max_loras=2)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], GREEDY, lora_name="a")
    engine.step()  # prefill + the first token under "a"
    engine.core.lora.remove("a")
    with pytest.raises(LookupError):
        engine.add_request(PROMPTS[0], GREEDY, lora_name="a")
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    assert final is not None and final.outputs[0].token_ids == peft_greedy["a"][0]
    assert "a" not in engine.core.lora.retiring and "a" not in engine.core.lora.slots
