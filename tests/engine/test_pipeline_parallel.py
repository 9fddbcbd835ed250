"""Pipeline parallelism on CPU (gloo, spawned ranks): PP=2 greedy tokens equal PP=1 (chunked, preempted,
prefix-cached; tied embeddings, MoE, sliding window, an uneven layer split), tensor x pipeline on four
ranks, each stage holds only its layers and their KV, seeded sampling agrees across stages, a killed
stage fails the engine loudly, unsupported settings are refused by name."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams
from services.engine.executor.worker_messages import WorkerDiedError
from services.engine.worker.parallel.pp_stage import PPStage, layer_split
from tests.checkpoints import build_checkpoint
from tests.engine.test_tensor_parallel import GREEDY, _prompts, _shared, _tokens


def _pair(model: Path, pp: int = 2, **kw) -> Iterator[tuple[LLM, LLM]]:
    one = LLM(model=str(model), dtype="float32", **kw)
    staged = LLM(model=str(model), dtype="float32", pipeline_parallel_size=pp, **kw)
    try:
        yield one, staged
    finally:
        staged.shutdown()


@pytest.fixture(scope="module")
def llama_pair(llama_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    yield from _pair(llama_dir, num_kv_blocks=512, max_num_batched_tokens=37, max_num_seqs=8)


def test_layer_split_is_contiguous_and_even() -> None:
    assert layer_split(2, 2) == [(0, 1), (1, 2)]
    assert layer_split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    stage = PPStage.of(1, 3, 7)
    assert (stage.start, stage.end, stage.is_first, stage.is_last) == (3, 5, False, False)
    assert stage.reads("model.layers.4.mlp.down_proj.weight")
    assert not stage.reads("model.layers.5.mlp.down_proj.weight")
    assert stage.reads("model.embed_tokens.weight") and stage.reads("lm_head.weight")
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        layer_split(2, 3)


def test_pp2_equals_pp1_chunked_and_prefix_cached(llama_pair) -> None:
    one, staged = llama_pair
    assert _tokens(staged, _prompts()) == _tokens(one, _prompts())
    shared = _shared()
    assert _tokens(staged, shared) == _tokens(one, shared)
    again = staged.generate(shared, GREEDY)  # the prefix is cached on every stage
    assert [o.outputs[0].token_ids for o in again] == _tokens(one, shared)
    assert all(o.num_cached_tokens >= 64 for o in again)


def test_each_stage_holds_its_layers(llama_pair) -> None:
    one, staged = llama_pair
    full, first = one.worker_stats(), staged.worker_stats()
    assert "OtherStage" in first.layer_kinds and "OtherStage" not in full.layer_kinds  # layer 1, the LM head
    assert (
        first.weight_bytes < 0.75 * full.weight_bytes
    )  # the embedding and one of two layers; no norm, no head
    assert first.kv_cache_shape[1] == full.kv_cache_shape[1] // 2


def test_seeded_sampling_agrees_across_stages(llama_pair) -> None:
    """Every stage samples from the last stage's logits with the same seeds: rank 0 checks each step
    that the other stage's tokens equal its own (a mismatch raises WorkerDiedError)."""
    _, staged = llama_pair
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    assert all(len(t) == 12 for t in _tokens(staged, _prompts(6), params))


def test_pp2_equals_pp1_under_preemption(llama_dir: Path) -> None:
    for one, staged in _pair(llama_dir, num_kv_blocks=40, max_num_seqs=16, max_model_len=512):
        assert _tokens(staged, _prompts()) == _tokens(one, _prompts())
        assert staged.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["qwen2", "mixtral", "phi3", "gpt_oss"])
def test_pp2_equals_pp1_across_families(kind: str, family_dir, qwen2_dir: Path) -> None:
    """Qwen2: tied embeddings (the last stage's LM head reads the embedding tensor); Mixtral: experts;
    Phi-3: fused checkpoint tensors and a sliding window that frees blocks; gpt-oss: sinks, its own
    experts and norms."""
    model = qwen2_dir if kind == "qwen2" else family_dir(kind)
    for one, staged in _pair(model, num_kv_blocks=256, max_num_batched_tokens=61):
        assert _tokens(staged, _prompts(8)) == _tokens(one, _prompts(8))


def test_three_layers_over_three_stages_and_tensor_by_pipeline(tmp_path: Path) -> None:
    """Three stages of one layer each; then two stages of two tensor-parallel ranks each (four ranks)."""
    model = build_checkpoint(tmp_path / "llama3", "llama", layers=3)
    for one, staged in _pair(model, pp=3, num_kv_blocks=256, max_num_batched_tokens=61):
        assert _tokens(staged, _prompts(6)) == _tokens(one, _prompts(6))
        grid = LLM(
            model=str(model), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
            num_kv_blocks=256, max_num_batched_tokens=61,
        )  # fmt: skip
        try:
            assert _tokens(grid, _prompts(6)) == _tokens(one, _prompts(6))
            core = grid.engine.core
            assert core.tp is not None and core.pp is not None and (core.pp.start, core.pp.end) == (0, 2)
            shape = grid.worker_stats().kv_cache_shape
            assert shape[1] == 2 and shape[4] == 1
        finally:
            grid.shutdown()


def test_a_killed_stage_fails_the_engine(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        assert _tokens(llm, [[5, 6, 7]]) and len(llm.engine.core._parallel.procs) == 1
        os.kill(llm.engine.core._parallel.procs[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            _tokens(llm, [[5, 6, 7]])
    finally:
        llm.shutdown()


def test_unsupported_settings_are_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="enable_lora is not supported with pipeline parallelism"):
        LLM(model=str(llama_dir), pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        LLM(model=str(llama_dir), pipeline_parallel_size=3)
