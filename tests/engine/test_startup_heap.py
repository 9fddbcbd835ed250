"""The engine's startup heap is frozen out of full GC passes while it runs; logits stay in the model's dtype
until a sampler needs fp32."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from services.engine import LLM, SamplingParams


def test_startup_heap_is_frozen_while_the_engine_runs(llama_dir: Path) -> None:
    """After start-up the loaded heap sits in the permanent generation; shutdown hands it back to the GC."""
    gc.unfreeze()
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=32)
    try:
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_logits_stay_in_the_model_dtype_for_greedy_sampling(llama_dir: Path) -> None:
    """compute_logits(fp32=False) is the bf16 product itself (fp32 widens it exactly), and greedy sampling
    from it picks the tokens it picks from the fp32 logits."""
    llm = LLM(model=str(llama_dir), dtype="bfloat16", num_kv_blocks=32)
    try:
        model = llm.engine.core.runner.model
        hidden = torch.randn(5, model.cfg.hidden_size, dtype=torch.bfloat16)
        raw, wide = model.compute_logits(hidden, fp32=False), model.compute_logits(hidden)
        assert raw.dtype == torch.bfloat16 and wide.dtype == torch.float32
        assert torch.equal(raw.float(), wide)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
        native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.core.runner
        logits = runner._logits
        runner._logits = lambda hidden, idx, fp32=True: logits(hidden, idx, True)  # the old fp32 path
        widened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert native == widened and all(len(t) == 6 for t in native)
    finally:
        llm.shutdown()
