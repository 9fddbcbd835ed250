"""The engine on the Triton backend produces the torch backend's greedy tokens.

On CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py): slow, so tiny shapes.
On a GPU the same comparison runs in fp32 and bf16 (@gpu).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams

PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 40)), [42], list(range(100, 120))]


def _run(
    model: Path, backend: str, device: str, dtype: str, prompts: list[list[int]] = PROMPTS, **kw
) -> list[list[int]]:
    llm = LLM(model=str(model), num_kv_blocks=64, attention_backend=backend, device=device, dtype=dtype, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_matches_torch_backend_interpreted(tiny_model: Path) -> None:
    # a 17-token budget mixes chunked prefill rows with decode rows in one step
    torch_out = _run(tiny_model, "torch", "cpu", "float32", max_num_batched_tokens=17)
    triton_out = _run(tiny_model, "triton", "cpu", "float32", max_num_batched_tokens=17)
    assert triton_out == torch_out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_matches_torch_backend_on_gpu(tiny_model: Path, dtype: str) -> None:
    torch_out = _run(tiny_model, "torch", "cuda", dtype)
    triton_out = _run(tiny_model, "triton", "cuda", dtype)
    if dtype == "float32":
        assert triton_out == torch_out
    else:  # bf16: rounding differs (fused kernels round once); the first tokens must still agree
        assert [t[:2] for t in triton_out] == [t[:2] for t in torch_out]
    assert torch.cuda.is_available()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_models_on_the_triton_backend_interpreted(family_dir, kind: str) -> None:
    """The fused MoE kernel in the engine (a shared expert, and a dense layer, for Qwen2-MoE)."""
    model = family_dir(kind)
    assert _run(model, "triton", "cpu", "float32") == _run(model, "torch", "cpu", "float32")


@pytest.mark.parametrize("kind", ["phi3", "qwen2_sw"])
def test_sliding_window_models_on_the_triton_backend_interpreted(family_dir, kind: str) -> None:
    """Windowed layers (every layer, freeing blocks / one of two) with prompts longer than the window,
    chunked so that prefill chunks start past it."""
    prompts = [*PROMPTS, [3 + i % 50 for i in range(70)]]
    model, kw = family_dir(kind), {"max_num_batched_tokens": 29}
    assert _run(model, "triton", "cpu", "float32", prompts, **kw) == _run(
        model, "torch", "cpu", "float32", prompts, **kw
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "phi3", "qwen2_sw"])
def test_moe_models_on_the_triton_backend_on_gpu(family_dir, kind: str) -> None:
    model = family_dir(kind)
    assert _run(model, "triton", "cuda", "float32") == _run(model, "torch", "cuda", "float32")
