"""Shard loading: a tensor-parallel rank reads only its slices of a safetensors checkpoint, so its peak
resident memory stays under its share of the weights (plus the process's own baseline), and TP=2 still
gives TP=1's greedy tokens on a checkpoint large enough (~180 MB fp32) for the difference to show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.worker.loader.model_loader import load_model_config
from services.engine.worker.models.llama import LLAMA_TP_PLAN
from services.engine.worker.parallel.tp_group import TPGroup
from services.engine.worker.parallel.tp_shard import TPShard
from tests.checkpoints import build_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_MARGIN = 32 * 2**20  # a slice in flight, allocator slack; reading through a memory map costs ~2x this


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 768, 4 layers, 16k vocabulary, untied: ~46M parameters, ~175 MiB in float32."""
    out = tmp_path_factory.mktemp("wide-llama")
    return build_checkpoint(out, "llama", hidden=768, layers=4, vocab_size=16000)


def _sizes(folder: Path) -> tuple[int, int]:
    """(all tensor bytes, bytes of the linear weights) of a one-file checkpoint."""
    from safetensors import safe_open

    total = linear = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            size = f.get_slice(name)[:].nbytes
            total += size
            linear += size if name.endswith(("_proj.weight", "lm_head.weight")) else 0
    return total, linear


def _rank1_peak(model: Path, prompts: list[list[int]], tp: int, **kw: str) -> tuple[list[list[int]], int]:
    llm = LLM(
        model=str(model), dtype="float32", num_kv_blocks=32, max_model_len=256, tensor_parallel_size=tp, **kw
    )
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        peak = llm.engine.core._parallel.load_memory[1].peak if tp > 1 else 0
    finally:
        llm.shutdown()
    return tokens, peak


def test_a_rank_reads_only_its_share_and_tp2_equals_tp1(wide_llama: Path, llama_dir: Path) -> None:
    """Rank 1's peak resident memory, less a rank's baseline (the same engine on a ~1 MB checkpoint:
    torch, gloo, the kernels), stays under its half of the weights plus oneDNN's pre-packed copies of its
    linear weights (fp32 keeps both) plus a margin; a rank reading whole tensors, or a memory map of the
    file, goes over by its share of the file."""
    full, linear = _sizes(wide_llama)
    assert full > 150 * 2**20
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 80))]
    _, baseline = _rank1_peak(llama_dir, prompts, 2)
    expected, _ = _rank1_peak(wide_llama, prompts, 1)
    tokens, peak = _rank1_peak(wide_llama, prompts, 2)
    assert tokens == expected
    grown, held = peak - baseline, (full + linear) / 2
    assert grown < held + _MARGIN, f"{grown / 2**20:.0f} MiB over the baseline, holding {held / 2**20:.0f}"
    assert grown > 0.8 * held  # the measurement sees the weights


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_a_quantizing_rank_reads_only_its_share(wide_llama: Path, llama_dir: Path, method: str) -> None:
    """Quantized at load, a rank reads its slices of the float checkpoint and quantizes them (row-parallel
    int8 rows take the whole rows' scales from the other ranks): TP=2 gives TP=1's tokens, and rank 1 grows
    by less than its float share (its float embedding, its int8/int4 codes, one float slice in flight). Reading whole tensors (or a memory map of the file) holds the float
    file's pages and goes over."""
    full, _ = _sizes(wide_llama)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 80))]
    _, baseline = _rank1_peak(llama_dir, prompts, 2, quantization=method)
    expected, _ = _rank1_peak(wide_llama, prompts, 1, quantization=method)
    tokens, peak = _rank1_peak(wide_llama, prompts, 2, quantization=method)
    assert tokens == expected
    grown = peak - baseline
    assert grown < full / 2, (
        f"{grown / 2**20:.0f} MiB over the baseline; the float file is {full / 2**20:.0f}"
    )


def test_slices_of_a_safetensors_file_equal_slices_of_the_whole_tensors(family_dir, qwen2_dir: Path) -> None:
    """Every fused, replicated-KV, vocab-padded and row-parallel case: reading a slice lazily is the same
    as slicing the whole tensor (Phi-3 has fused qkv and gate_up; Qwen2's one KV head is replicated)."""
    from safetensors import safe_open

    for folder in (family_dir("phi3"), qwen2_dir):
        cfg = load_model_config(folder)
        for rank in range(2):
            shard = TPShard(cfg, TPGroup(rank, 2), LLAMA_TP_PLAN)
            (path,) = folder.glob("*.safetensors")
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    lazy, whole = shard(name, f.get_slice(name)), shard(name, f.get_tensor(name))
                    assert torch.equal(lazy, whole), name
