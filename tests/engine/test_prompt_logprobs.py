"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo + logprobs) equal HF's, chunked, batched and preempted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.common.kv.kv_transfer import KVTransferParams
from services.engine import LLM, SamplingParams

PROMPTS = [[42], [5, 17, 33, 101, 7, 250], list(range(3, 73)), [(7 * i) % 240 + 1 for i in range(150)]]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(llama_dir: Path) -> list[torch.Tensor]:
    """HF's log-softmax at every prompt position: row p scores prompt token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0], -1) for p in PROMPTS]


def _check(outputs, refs: list[torch.Tensor], top_n: int) -> None:
    for out, prompt, ref in zip(outputs, PROMPTS, refs, strict=True):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        for p, lp in enumerate(lps[1:]):
            row, token = ref[p], prompt[p + 1]
            assert math.isclose(lp.token_logprob, float(row[token]), abs_tol=1e-4), (len(prompt), p)
            assert lp.rank == int((row > row[token]).sum()) + 1 or math.isclose(
                float(row.sort(descending=True).values[lp.rank - 1]), float(row[token]), abs_tol=1e-5
            )
            assert [t for t, _ in lp.top] == torch.topk(row, top_n).indices.tolist()


def test_prompt_logprobs_match_hf_whole_and_chunked(llama_dir: Path, hf_prompt_logprobs) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    whole = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8)
    _check(whole.generate(PROMPTS, params), hf_prompt_logprobs, 3)
    chunked = LLM(
        model=str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=37
    )
    outs = chunked.generate(PROMPTS, params)
    _check(outs, hf_prompt_logprobs, 3)
    plain = whole.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_skip_the_prefix_cache(llama_dir: Path, hf_prompt_logprobs) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8, block_size=16)
    warm = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    assert again[3].num_cached_tokens > 0 and warm[3].num_cached_tokens == 0
    scored = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert all(o.num_cached_tokens == 0 for o in scored)
    _check(scored, hf_prompt_logprobs, 0)


def test_prompt_logprobs_survive_preemption(llama_dir: Path, hf_prompt_logprobs) -> None:
    llm = LLM(
        model=str(llama_dir),
        dtype="float32",
        num_kv_blocks=14,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the tiny pool should have forced preemption"
    _check(outs, hf_prompt_logprobs, 1)


def test_prompt_logprobs_with_kv_transfer_is_refused(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.engine.add_request([1, 2, 3], params, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    assert not llm.engine.has_unfinished()
