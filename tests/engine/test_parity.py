"""Greedy output equals HF transformers token for token, also chunked, preempted and with prefix caching,
for every model family."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.checkpoints import FAMILY_KINDS

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 300, 299] + [rng.randint(1, 300) for _ in range(22)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _shared_prefix_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(2)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 100)]
    return [prefixes[i % 2] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for i in range(16)]


@pytest.fixture(scope="module", params=["llama", "qwen2", *FAMILY_KINDS])
def tiny_model(request: pytest.FixtureRequest, family_dir) -> Path:
    """Every family the engine serves: Llama, Qwen2, and Qwen3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE (the
    MoE ones with 8 experts, top-2, so routing differs per token)."""
    if request.param in ("llama", "qwen2"):
        return request.getfixturevalue(f"{request.param}_dir")
    return family_dir(request.param)


@pytest.fixture(scope="module")
def hf_reference(tiny_model: Path):
    """HF transformers' own greedy generate, one prompt at a time, memoized per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                    attention_mask=torch.ones_like(ids),
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return generate


def _vocab(path: Path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]


def _check(llm: LLM, prompts: list[list[int]], hf_reference) -> list:
    outs = llm.generate(prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.outputs[0].token_ids == hf_reference(prompt), f"prompt {i} (len {len(prompt)}) diverged"
    return outs


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batched_greedy_matches_hf(tiny_model: Path, hf_reference, backend: str) -> None:
    """The C++ kernels (the CPU default) and the plain torch backend (the reference and fallback)."""
    if backend == "cpu" and not _cpu_kernels():
        pytest.skip("the C++ CPU kernels cannot be built here")
    llm = LLM(
        model=str(tiny_model), dtype="float32", num_kv_blocks=1024, max_num_seqs=32, attention_backend=backend
    )
    assert llm.engine.core.runner.backend.name == backend
    _check(llm, _prompts(_vocab(tiny_model)), hf_reference)
    if backend == "cpu":  # steady decode steps advanced the last step's inputs in place
        assert llm.engine.core.runner.inputs.num_updated > NEW_TOKENS // 2


def _cpu_kernels() -> bool:
    import kvkernels.cpu

    return kvkernels.cpu.available()


def test_chunked_prefill_matches_hf(tiny_model: Path, hf_reference) -> None:
    llm = LLM(
        model=str(tiny_model), dtype="float32", num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=37
    )
    _check(llm, _prompts(_vocab(tiny_model)), hf_reference)


def test_preemption_matches_hf(tiny_model: Path, hf_reference) -> None:
    windowed = _windowed(tiny_model)  # its blocks before the window are freed: a smaller pool preempts
    blocks = 24 if windowed else 40
    llm = LLM(
        model=str(tiny_model),
        dtype="float32",
        num_kv_blocks=blocks,
        block_size=16,
        max_num_seqs=32,
        max_model_len=512,
    )
    _check(llm, _prompts(_vocab(tiny_model)), hf_reference)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the tiny pool should have forced preemption"
    assert llm.engine.core.kv_manager.pool.num_free_blocks == blocks


def _windowed(path: Path) -> bool:
    from services.engine.worker.model_config import ModelConfig

    return ModelConfig.from_folder(path).kv_window is not None


def test_prefix_cache_on_equals_off_and_hf(tiny_model: Path, hf_reference) -> None:
    prompts = _shared_prefix_prompts(_vocab(tiny_model))
    on = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=512, max_num_seqs=4)
    off = LLM(
        model=str(tiny_model), dtype="float32", num_kv_blocks=512, max_num_seqs=4, enable_prefix_caching=False
    )
    outs_on = _check(on, prompts, hf_reference)
    outs_off = _check(off, prompts, hf_reference)
    assert sum(o.num_cached_tokens for o in outs_on) > 0
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    # Run the same prompts again: now everything but each prompt's tail is a cache hit.
    again = _check(on, prompts, hf_reference)
    for prompt, out in zip(prompts, again, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
