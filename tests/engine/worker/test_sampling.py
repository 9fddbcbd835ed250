"""Sampling on the tiny model: seeds, filters, penalties, logprobs, min_tokens, stop tokens and strings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams

PROMPT = [5, 17, 33, 101, 7, 250]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=16, seed=0)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(llm, [PROMPT], p)[0]
    again = _tokens(llm, [PROMPT], p)[0]
    noise = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)
    in_batch = (
        llm.generate([[9, 9, 9], PROMPT, list(range(3, 90))], [noise, p, noise])[1].outputs[0].token_ids
    )
    assert alone == again == in_batch
    other_seed = _tokens(llm, [PROMPT], p.model_copy(update={"seed": 99}))[0]
    assert other_seed != alone


@pytest.mark.parametrize("penalties", [False, True])
def test_a_seeded_stream_resumes_from_its_prompt_plus_its_tokens(llm: LLM, penalties: bool) -> None:
    """The draw at a position depends on (seed, absolute position): prompt + the first ``cut`` tokens as
    the prompt (``resumed_output_tokens`` so penalties count them as output) continues the same stream."""
    shaping = (
        {"frequency_penalty": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.3} if penalties else {}
    )
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=77, ignore_eos=True, **shaping)
    whole = _tokens(llm, [PROMPT], p)[0]
    for cut in (1, 6, 15):
        resumed = p.model_copy(update={"max_tokens": 16 - cut, "resumed_output_tokens": cut})
        rest = _tokens(llm, [PROMPT + whole[:cut]], resumed)[0]
        assert whole[:cut] + rest == whole, cut


def test_top_k_one_is_greedy_and_temperature_explores(llm: LLM) -> None:
    greedy = _tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    topk1 = _tokens(llm, [PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))[
        0
    ]
    assert greedy == topk1
    hot = _tokens(llm, [PROMPT] * 6, SamplingParams(temperature=2.0, max_tokens=10, ignore_eos=True))
    assert len({tuple(t) for t in hot}) > 1


def test_repetition_and_frequency_penalties_reduce_repeats(llm: LLM) -> None:
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _tokens(llm, [PROMPT], base)[0]
    penal = _tokens(
        llm, [PROMPT], base.model_copy(update={"frequency_penalty": 2.0, "presence_penalty": 2.0})
    )[0]
    rep = _tokens(llm, [PROMPT], base.model_copy(update={"repetition_penalty": 5.0}))[0]
    assert len(set(penal)) > len(set(plain)) or len(set(plain)) == len(plain)
    assert len(set(rep)) >= len(set(plain))


def test_logprobs_match_hf_distribution(llm: LLM, llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1], -1)
    lp = out.logprobs[0]
    assert lp.rank == 1 and math.isclose(lp.token_logprob, float(ref.max()), abs_tol=1e-4)
    top_ids = [t for t, _ in lp.top]
    assert top_ids == torch.topk(ref, 5).indices.tolist()


def test_min_tokens_suppresses_eos_and_stop_token_ids_stop(llm: LLM) -> None:
    greedy = _tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_at = greedy[3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[
        0
    ].outputs[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    held = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], min_tokens=8)
    )[0].outputs[0]
    assert len(held.token_ids) == 8 and stop_at not in held.token_ids and held.finish_reason == "length"


def test_stop_strings_are_never_in_the_text(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[
        0
    ]
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[
        0
    ]
    got = out.outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == text[: text.index(stop)] and stop not in got.text
    assert llm.engine.core.kv_manager.pool.num_free_blocks == llm.engine.core.num_blocks


def test_n_sequences_with_seed(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[
        0
    ]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_plain_greedy_rows_take_the_argmax_fast_path() -> None:
    """Plain greedy rows are sampled from the raw logits (bf16 here, no fp32 copy); the result equals the
    general path's, which rows with penalties or logprobs in the batch still take."""
    from services.engine.worker.sampler import Sampler, SamplingRow

    torch.manual_seed(0)
    logits = torch.randn(6, 4099).bfloat16()
    logits[2, 10] = logits[2, 3000] = logits[2].max() + 1  # a tie
    greedy = SamplingParams(temperature=0, max_tokens=4)
    rows = [SamplingRow(greedy, [1, 2], [3], (0,)) for _ in range(6)]
    assert all(r.plain_greedy for r in rows)
    out = Sampler()(logits, rows)
    fast, lps = out.tokens, out.logprobs
    expected = logits.float().max(dim=-1).indices.tolist()
    assert fast == expected and expected[2] == 10 and lps == [None] * 6
    with_lp = [*rows[:5], SamplingRow(greedy.model_copy(update={"logprobs": 1}), [1], [], ())]
    assert not with_lp[5].plain_greedy
    out = Sampler()(logits, with_lp)
    slow, lps = out.tokens, out.logprobs
    assert slow == expected and lps[5] is not None
    min_tokens = SamplingRow(greedy.model_copy(update={"min_tokens": 3}), [1], [], (int(expected[0]),))
    assert not min_tokens.plain_greedy
    assert Sampler()(logits[:1], [min_tokens]).tokens[0] != expected[0]  # eos masked before min_tokens


def test_seeded_noise_depends_only_on_the_key_and_is_exponential() -> None:
    from services.engine.worker.seeded_noise import seeded_exponential

    keys = torch.tensor([7, 8, 7, 2**62 + 5], dtype=torch.int64)
    noise = seeded_exponential(keys, 50_000)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[3])
    assert abs(float(noise.mean()) - 1.0) < 0.01 and abs(float(noise.var()) - 1.0) < 0.03
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


@pytest.mark.parametrize("seeded", [False, True])
def test_batched_filters_draw_from_the_filtered_distribution(seeded: bool) -> None:
    """4,000 rows in one batch: temperature-1 draws follow the probabilities; top-k, top-p and min-p keep
    exactly the tokens vLLM/OpenAI keep."""
    from services.engine.worker.sampler import Sampler, SamplingRow

    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().repeat(4000, 1)

    def draw(**kw: object) -> torch.Tensor:
        rows = [
            SamplingRow(SamplingParams(temperature=1.0, seed=i if seeded else None, **kw), [1], [], ())
            for i in range(4000)
        ]
        return torch.tensor(Sampler(seed=3)(logits.clone(), rows).tokens)

    freq = torch.bincount(draw(), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    assert set(draw(top_k=2).tolist()) == {0, 1}
    assert set(draw(top_p=0.6).tolist()) == {0, 1}  # mass before token 2 is 0.75 >= 0.6
    assert set(draw(min_p=0.35).tolist()) == {0, 1}  # 0.15 < 0.35 * 0.5
