"""Every feature composes with tensor parallelism (CPU, gloo, 2 ranks): quantized weights (at load and from
GPTQ / AWQ / FP8 checkpoints), a mixed batch of LoRA adapters, and decoder embeddings equal TP=1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.worker.lora.test_lora import ADAPTERS, _write_adapter
from tests.quant_writers import write_fp8, write_quantized

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 60)), [42, 43], list(range(100, 130)), [7, 7, 7, 8]]


def _greedy(model: Path, tp: int, pp: int = 1, **kw) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, **kw)  # fmt: skip
    try:
        if "quantization" in kw:  # rank 0 holds quantized layers (the other ranks agree on every token)
            assert llm.worker_stats().layer_kinds & {"Int8Linear", "Int4Linear"}
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def _gptq(src: Path, out: Path) -> Path:
    write_quantized(src, out, "gptq", bits=4, group=32)
    return out


def _awq(src: Path, out: Path) -> Path:
    write_quantized(src, out, "awq", bits=4, group=32)
    return out


def _fp8(src: Path, out: Path) -> Path:
    write_fp8(src, out, "channel")
    return out


CHECKPOINTS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    "gptq": ("mistral", _gptq),
    "awq": ("qwen2", _awq),  # with biases and a tied head
    "fp8": ("mistral", _fp8),  # runs as int8 per row on the CPU
}


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_quantized_at_load_tp2_equals_tp1(llama_dir: Path, method: str) -> None:
    """Each rank quantizes the whole layer and keeps its cut of the codes and scales: the same numbers."""
    assert _greedy(llama_dir, 2, quantization=method) == _greedy(llama_dir, 1, quantization=method)


@pytest.mark.slow  # (the default run keeps int8 at load under TP=2)
def test_quantized_pp2_equals_pp1(llama_dir: Path) -> None:
    assert _greedy(llama_dir, 1, pp=2, quantization="int8") == _greedy(llama_dir, 1, quantization="int8")


@pytest.mark.slow  # each checkpoint format: make test-all
@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_quantized_checkpoints_tp2_equal_tp1(kind: str, request, tmp_path: Path) -> None:
    base, write = CHECKPOINTS[kind]
    folder = write(request.getfixturevalue(f"{base}_dir"), tmp_path / kind)
    assert _greedy(folder, 2) == _greedy(folder, 1)


def test_act_order_weights_are_refused_with_the_reason(mistral_dir: Path, tmp_path: Path) -> None:
    write_quantized(mistral_dir, tmp_path / "gptq", "gptq", bits=4, group=32, act_order=True)
    with pytest.raises(ValueError, match="act-order"):
        LLM(model=str(tmp_path / "gptq"), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-loras")
    return {n: _write_adapter(llama_dir, root / n, i, *spec) for i, (n, spec) in enumerate(ADAPTERS.items())}


def test_lora_mixed_batch_tp2_equals_tp1(llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Adapters on every target (embedding and LM head too) in one batch; one loaded after start-up."""
    first = {n: str(p) for n, p in adapters.items() if n != "d"}
    names = [None, "a", "b", "c", "d"]
    jobs = [(p, names[(i + j) % 5]) for i, p in enumerate(PROMPTS) for j in range(5)]
    outs = []
    for tp in (1, 2):
        llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=128, tensor_parallel_size=tp,
                  enable_lora=True, max_lora_rank=16, max_loras=3, lora_modules=first)  # fmt: skip
        try:
            llm.engine.core.update_lora("d", str(adapters["d"]))  # reaches every rank
            got = llm.generate([p for p, _ in jobs], GREEDY, lora_name=[n for _, n in jobs])
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.shutdown()
    assert outs[1] == outs[0]
    assert outs[0][1] != outs[0][0]  # the adapters change the tokens


@pytest.mark.slow
def test_decoder_embeddings_tp2_equal_tp1(llama_dir: Path) -> None:
    def embed(tp: int) -> torch.Tensor:
        llm = LLM(model=str(llama_dir), dtype="float32", task="embed", tensor_parallel_size=tp)
        try:
            return torch.tensor(llm.embed(PROMPTS))
        finally:
            llm.shutdown()

    one, two = embed(1), embed(2)
    assert torch.nn.functional.cosine_similarity(one, two).min() >= 0.9999


def test_vision_model_tp2_equals_tp1(tmp_path: Path) -> None:
    """LLaVA: the language model sharded, the CLIP tower and projector replicated on every rank."""
    from tests.checkpoints import build_llava
    from tests.engine.test_llava import _cases, _marker

    llava = build_llava(tmp_path / "llava")
    cases = _cases(_marker(llava))
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
    outs = []
    for tp in (1, 2):
        llm = LLM(model=str(llava), dtype="float32", num_kv_blocks=128, tensor_parallel_size=tp)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        finally:
            llm.shutdown()
    assert outs[1] == outs[0]


def test_kvstore_blocks_written_by_tp2_read_back_by_tp2_and_tp1(llama_dir: Path) -> None:
    """The kvstore holds whole blocks in the unsharded layout (the ranks' shards joined by KV head), so a
    TP=2 engine reads back what a TP=2 engine wrote, and so does a TP=1 engine."""
    from tests.kvstore_server import running_kvstore

    prompts = [list(range(3, 83)), list(range(100, 170))]
    runs = []
    with running_kvstore(capacity_gb="0.05") as target:
        for tp in (2, 2, 1):  # the writer, then two fresh readers
            llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp,
                      kvstore_url=f"grpc://{target}")  # fmt: skip
            try:
                outs = llm.generate(prompts, GREEDY)
                runs.append(([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]))
            finally:
                llm.shutdown()
    (written, none), *reads = runs
    assert max(none) == 0
    for tokens, cached in reads:  # every full prompt block came from the store, the tokens unchanged
        assert tokens == written and min(cached) >= 64


@pytest.mark.slow
def test_mixtral_int8_experts_tp2_equal_tp1(family_dir) -> None:
    """Experts sharded and held as int8: w2's row scales come from the whole rows (a max over the ranks)."""
    mixtral = family_dir("mixtral")
    assert _greedy(mixtral, 2, quantization="int8") == _greedy(mixtral, 1, quantization="int8")
