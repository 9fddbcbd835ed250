"""--gpu-memory-utilization sizes the KV cache from the device's free memory after a profile step at the
full token budget (vLLM's profile run); CPU engines are unchanged (tests/engine/worker/test_loading.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams
from services.engine.worker.memory_profile import dummy_prompts, profile_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 300)), [42]]


def test_dummy_prompts_fill_the_budget_with_up_to_max_seqs_prompts() -> None:
    assert dummy_prompts(2048, 256, 4096) == [8] * 256
    assert dummy_prompts(10, 4, 4096) == [3, 3, 2, 2]
    assert dummy_prompts(3, 8, 4096) == [1, 1, 1]
    assert dummy_prompts(8192, 1, 1024) == [1023]  # one prompt never exceeds the model's length
    assert profile_blocks([16, 17, 1], 16) == 1 + 2 + 1


@pytest.mark.gpu
def test_kv_cache_takes_what_the_utilization_leaves_after_weights_and_the_profile_step(
    llama_dir: Path,
) -> None:
    import torch

    free, total = torch.cuda.mem_get_info()
    util = min(0.95, (total - free + 2 * 2**30) / total)  # about 2 GiB for the step and the KV cache
    kw = dict(model=str(llama_dir), dtype="float32", device="cuda", max_model_len=1024)
    llm = LLM(**kw, gpu_memory_utilization=util, max_num_batched_tokens=4096, max_num_seqs=4096)
    core = llm.engine.core
    assert core._activation_bytes is not None and core._activation_bytes > 0
    kv_bytes = llm.worker_stats().kv_cache_bytes
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    assert used <= util * total + 64 * 2**20  # the cache filled the budget, not more
    assert kv_bytes > 2 * 2**30 - core._activation_bytes - 512 * 2**20  # ... and not much less
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    del llm
    fixed = LLM(**kw, num_kv_blocks=256)  # no profile step: the tokens do not depend on it
    assert fixed.engine.core._activation_bytes is None
    assert [o.outputs[0].token_ids for o in fixed.generate(PROMPTS, GREEDY)] == tokens
