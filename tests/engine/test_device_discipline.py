"""Device discipline without a GPU: every stage of a step runs 'on cuda' under FakeCuda (tests/engine/
fake_cuda.py) and must never let a CPU tensor meet a GPU one; its output must equal the CPU run's.

Each test names its stage; a mix-up fails it with that name and the line that mixed. The engine runs
on the plain torch backend (the Triton kernels need a real GPU; they have their own @gpu tests).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvkernels.cpu as cpu_kernels
from services.common.openai.protocol_structured import StructuredSpec
from services.engine import LLM, SamplingParams
from tests.checkpoints import build_llava, build_tokenizer
from tests.engine.fake_cuda import fake_cuda

PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 40)), [42, 42, 43]]


def _no_cpu_kernels() -> None:
    raise AssertionError("a GPU engine asked for the C++ CPU kernels (a GPU pod must not compile them)")


def _on(
    device: str, model: Path, run: Callable[[LLM], Any], monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> Any:
    """``run(llm)`` with an engine on the CPU, or on 'cuda' under FakeCuda (which must see no mix-up)."""
    settings = dict(num_kv_blocks=64, attention_backend="torch", dtype="float32") | kw
    if device == "cpu":
        return run(LLM(model=str(model), device="cpu", **settings))
    with monkeypatch.context() as mp, fake_cuda(mp) as mode:
        mp.setattr(cpu_kernels, "load", _no_cpu_kernels)  # a GPU engine never builds or loads them
        result = run(LLM(model=str(model), device="cuda", **settings))
    assert not mode.mixups, "device mix-up:\n" + "\n".join(mode.mixups)
    return result


def _same_on_both(
    stage: str, model: Path, run: Callable[[LLM], Any], monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> Any:
    on_cpu = _on("cpu", model, run, monkeypatch, **kw)
    try:
        on_gpu = _on("cuda", model, run, monkeypatch, **kw)
    except Exception as exc:  # noqa: BLE001 - a mix-up fails a step, an embedding or the assertion above
        pytest.fail(f"stage {stage!r}: {exc}")
    assert on_gpu == on_cpu, f"stage {stage!r}: the 'cuda' run differs from the CPU run"
    return on_gpu


def _tokens(params: SamplingParams | list[SamplingParams], prompts: list = PROMPTS, **kw: Any) -> Callable:
    def run(llm: LLM) -> list[tuple[list[int], str | None]]:
        outs = llm.generate(prompts, params, **kw)
        return [(o.token_ids, o.finish_reason) for r in outs for o in r.outputs]

    return run


SAMPLED = {
    "temperature": SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
    "top-p/top-k/min-p": SamplingParams(
        temperature=1.0, top_p=0.9, top_k=20, min_p=0.05, seed=2, max_tokens=6, ignore_eos=True
    ),
    "penalties": SamplingParams(
        temperature=0.7,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        max_tokens=6,
        ignore_eos=True,
    ),
    "logit_bias+min_tokens": SamplingParams(
        temperature=0, logit_bias={7: 5.0, 11: -100.0}, min_tokens=4, max_tokens=6, stop_token_ids=[7]
    ),
    "logprobs+n": SamplingParams(n=2, temperature=1.0, seed=4, logprobs=3, max_tokens=4, ignore_eos=True),
}


@pytest.mark.parametrize("stage", list(SAMPLED))
def test_sampling_stage_on_cuda(llama_dir: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    _same_on_both(f"sampler: {stage}", llama_dir, _tokens(SAMPLED[stage]), monkeypatch)


def test_mixed_batch_and_unseeded_rows_on_cuda(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, seeded and unseeded rows in one step (unseeded draws differ by device: only shapes compared)."""
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.5, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=9, max_tokens=5, ignore_eos=True),
    ]
    run = _tokens(params)
    cpu = _on("cpu", llama_dir, run, monkeypatch)
    gpu = _on("cuda", llama_dir, run, monkeypatch)
    assert gpu[0] == cpu[0] and gpu[2] == cpu[2], "sampler: greedy and seeded rows are device-independent"
    assert [len(t) for t, _ in gpu] == [5, 5, 5]


def test_grammar_mask_stage_on_cuda(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = StructuredSpec.of("regex", r"(cat|dog)-[0-9]{2,4}")
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, structured_outputs=spec)
    _same_on_both("grammar bitmask", llama_dir, _tokens(params, PROMPTS[:2]), monkeypatch)


def test_grammar_end_wins_over_min_tokens(llama_dir: Path) -> None:
    """A choice whose text is done allows only EOS: min_tokens must not mask it into token 0 (issue 32)."""
    llm = LLM(model=str(llama_dir), num_kv_blocks=64, dtype="float32")
    spec = StructuredSpec.of("choice", ["yes", "no"])
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=spec)
    )
    got = out[0].outputs[0]
    assert got.text in ("yes", "no") and got.finish_reason == "stop"


def test_no_allowed_token_fails_only_that_request(llama_dir: Path) -> None:
    """A constraint that allows one token, biased to -inf... is still allowed (bias is finite); a stop-only
    row under min_tokens keeps its stop; a row with no token at all fails with a clear error."""
    import torch

    from services.engine.worker.sampler import Sampler, SamplingRow, TokenMask

    logits = torch.randn(2, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)  # row 0 allows nothing
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], ()) for _ in range(2)]
    mask = TokenMask(torch.tensor([0]), torch.tensor([0]), bitmask)
    out = Sampler()(logits, rows, mask)
    assert out.no_token_rows == (0,) and out.tokens[0] == -1 and out.tokens[1] == int(logits[1].argmax())


def test_embedding_pooling_stage_on_cuda(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import BertConfig, BertModel

    out = tmp_path_factory.mktemp("device-bert")
    vocab = build_tokenizer(out)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(cfg).save_pretrained(str(out))

    def run(llm: LLM) -> list[list[float]]:
        return [[round(x, 5) for x in e] for e in llm.embed([[1, 5, 9, 2], [1, 7, 2]])]

    _same_on_both("pooling", out, run, monkeypatch, task="embed")


def test_spec_decode_verification_on_cuda(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 30))]
    for params in (
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=6, max_tokens=8, ignore_eos=True),
    ):
        _same_on_both("spec-decode verification", llama_dir, _tokens(params, prompts), monkeypatch,
                      speculative_config=spec)  # fmt: skip


def test_lora_stage_on_cuda(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.engine.worker.lora.test_lora import _write_adapter

    root = tmp_path_factory.mktemp("device-lora")
    adapters = {
        "a": _write_adapter(llama_dir, root / "a", 0, 8, 16, ["q_proj", "v_proj", "down_proj"], False)
    }
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    run = _tokens(params, PROMPTS[:2], lora_name=["a", None])
    _same_on_both("LoRA", llama_dir, run, monkeypatch, enable_lora=True, max_lora_rank=8,
                  lora_modules={n: str(p) for n, p in adapters.items()})  # fmt: skip


def test_moe_routing_on_cuda(family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _same_on_both("MoE routing", family_dir("mixtral"), _tokens(params, PROMPTS[:2]), monkeypatch)


def test_multimodal_merge_on_cuda(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import numpy as np
    from PIL import Image

    model = build_llava(tmp_path_factory.mktemp("device-llava"))
    marker = json.loads((model / "config.json").read_text())["image_token_index"]
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    prompt = {"prompt_token_ids": [1, 5, 6, marker, 7, 8], "multi_modal_data": {"image": [image]}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _same_on_both("multimodal merge", model, _tokens(params, [prompt]), monkeypatch)


def test_memory_profile_step_runs_the_worst_case_sampler_on_cuda(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--gpu-memory-utilization profiles a step whose every row samples as the worst request would."""
    from services.engine.worker.memory_profile import WORST_CASE
    from services.engine.worker.sampler import Sampler

    seen: list[tuple[int, bool, SamplingParams]] = []
    real = Sampler.__call__

    def spy(self: Sampler, logits: Any, rows: list, mask: Any = None) -> Any:
        seen.append((len(rows), mask is not None, rows[0].params))
        return real(self, logits, rows, mask)

    monkeypatch.setattr(Sampler, "__call__", spy)
    with monkeypatch.context() as mp, fake_cuda(mp) as mode:
        LLM(model=str(llama_dir), device="cuda", attention_backend="torch", dtype="float32",
            gpu_memory_utilization=0.2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)  # fmt: skip
    assert not mode.mixups, "memory profile step:\n" + "\n".join(mode.mixups)
    assert seen == [(4, True, WORST_CASE)]
