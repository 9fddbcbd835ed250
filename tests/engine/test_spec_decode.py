"""Speculative decoding end to end: greedy and seeded output equal plain decoding, sampling keeps the target's
distribution, stops land exactly, blocks all return (tiny random-weight checkpoints, in-process engines)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.checkpoints import build_checkpoint, build_eagle_head, truncated_checkpoint

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    list(range(20, 60)),
    [3] * 10,
    [11, 12, 13, 14],
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft that disagrees with the tiny llama most of the time (other random weights, same tokenizer)."""
    return build_checkpoint(tmp_path_factory.mktemp("draft-other"), "llama", seed=1)


def _specs(model: Path, tmp: Path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "self": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(model)},
        "truncated": {
            "method": "draft_model",
            "num_speculative_tokens": 2,
            "model": str(truncated_checkpoint(model, tmp / f"{model.name}-1layer", 1)),
            "min_acceptance": 0,  # a weak draft: keep it drafting so every step verifies
        },
        "eagle": {
            "method": "eagle",
            "num_speculative_tokens": 3,
            "model": str(build_eagle_head(model, tmp / f"{model.name}-eagle")),
            "min_acceptance": 0,  # a random head: keep it drafting so every step verifies
        },
    }


def _generate(model: Path, prompts: list, params: SamplingParams, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(model), dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


def _all_blocks_free(llm: LLM) -> bool:
    core = llm.engine.core
    return core.kv_manager.pool.num_free_blocks == core.num_blocks and not core.kv_manager.req_to_blocks


SETTINGS = {
    "default": dict(num_kv_blocks=128),
    # chunked prefill (8-token budget) and prefix caching (prompts share a 15-token prefix)
    "chunked-prefix": dict(num_kv_blocks=128, max_num_batched_tokens=8, block_size=4),
    # 34 blocks of 4 tokens for four ~90-token sequences: requests are preempted and recomputed
    "preempted": dict(num_kv_blocks=34, block_size=4, max_model_len=128),
}


@pytest.mark.parametrize("method", ["ngram", "self", "truncated", "eagle"])
def test_greedy_equals_plain_decoding(tiny_model: Path, tmp_path_factory, method: str) -> None:
    spec = _specs(tiny_model, tmp_path_factory.getbasetemp())[method]
    prompts = PROMPTS + [PROMPTS[0] + [30, 31]]
    for name, kw in SETTINGS.items():
        plain, _ = _generate(tiny_model, prompts, GREEDY, **kw)
        ours, llm = _generate(tiny_model, prompts, GREEDY, speculative_config=spec, **kw)
        assert ours == plain, f"{method} / {name}"
        stats = llm.engine.core.scheduler.spec_stats
        if method == "eagle":  # a random head is rarely right; it must draft in every step
            assert stats.num_draft_tokens > 3 * len(prompts) * 10, f"{method} / {name}"
        else:
            assert stats.num_accepted_tokens > 0, f"{method} / {name}: no draft was ever accepted"
        assert _all_blocks_free(llm), f"{method} / {name}: blocks leaked"
        if name == "preempted":
            assert llm.engine.core.scheduler.num_preemptions > 0


def test_the_target_as_its_own_draft_accepts_everything(llama_dir: Path) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(llama_dir)}
    _, llm = _generate(llama_dir, PROMPTS, GREEDY, num_kv_blocks=128, speculative_config=spec)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 40 and stats.acceptance_rate == 1.0
    assert stats.accepted_per_pos[0] == stats.num_drafts  # (the last rounds draft fewer: max_tokens)


def test_seeded_sampling_gives_the_same_text(llama_dir: Path, other_draft: Path) -> None:
    """The property tested: with a per-request seed, the token at each output position is drawn from
    that position's seeded noise, so accepted drafts and the token after them are the tokens plain
    decoding draws (same seed, same text), whatever the drafts were."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in range(4)
    ]
    plain = [
        o.outputs[0].token_ids for o in LLM(model=str(llama_dir), dtype="float32").generate(PROMPTS, params)
    ]
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": str(other_draft)},
    ):
        llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain, spec["method"]


def test_logprobs_are_the_targets(llama_dir: Path) -> None:
    """Accepted drafts carry the target's logprobs (and top-n), as plain decoding reports them."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(model=str(llama_dir), dtype="float32").generate(PROMPTS[2:3], params)[0].outputs[0]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec)
    ours = llm.generate(PROMPTS[2:3], params)[0].outputs[0]
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 5
    assert ours.token_ids == plain.token_ids and len(ours.logprobs) == 24
    for a, b in zip(ours.logprobs, plain.logprobs, strict=True):
        assert a.rank == b.rank and abs(a.token_logprob - b.token_logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _exact_pair_distribution(model: Path, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """p(t1, t2) of the target with temperature 1 and top-k, from HF transformers' logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def top(ids: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        vals, idx = torch.topk(logits, top_k)
        return list(zip(idx.tolist(), torch.softmax(vals, -1).tolist(), strict=True))

    return {(t1, t2): p1 * p2 for t1, p1 in top(prompt) for t2, p2 in top(prompt + [t1])}


def test_sampling_keeps_the_target_distribution(llama_dir: Path, tmp_path_factory) -> None:
    """Unseeded draws of (t1, t2) with a draft that is sometimes right (the target's first layer): a
    chi-square goodness-of-fit test against the target's exact distribution (16 cells, df 15; 37.7 is
    the 0.1% critical value)."""
    prompt, n = PROMPTS[0], 1200
    exact = _exact_pair_distribution(llama_dir, prompt, top_k=4)
    spec = {**_specs(llama_dir, tmp_path_factory.getbasetemp())["truncated"], "min_acceptance": 0}
    llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec, seed=3, num_kv_blocks=512)
    # max_tokens 3: t1 ends the prefill, t2 is verified as a draft (accepted or resampled), t3 follows
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in llm.generate([prompt] * n, params))
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts >= n // 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in exact.items())
    assert chi2 < 37.7, (chi2, counts)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_stops_inside_an_accepted_run(llama_dir: Path, tmp_path_factory, method: str) -> None:
    """max_tokens, a stop id and a stop string that fall inside a run of accepted drafts (the target as
    its own draft accepts every draft, so each stop lands inside a run) end the output exactly there."""
    spec = _specs(llama_dir, tmp_path_factory.getbasetemp())[method]
    prompt = PROMPTS[2]
    ref = _generate(llama_dir, [prompt], GREEDY)[0][0]
    llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec)
    for n in (1, 2, 7, 13, 33):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == ref[:n] and out.outputs[0].finish_reason == "length"
    stop_id = ref[30]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == ref[: ref.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    text = llm.tokenizer.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert out.outputs[0].text == text[: text.index(stop)] and out.outputs[0].finish_reason == "stop"
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    assert _all_blocks_free(llm)


def test_poor_drafts_turn_speculation_down(llama_dir: Path, other_draft: Path) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(other_draft)}
    plain, _ = _generate(llama_dir, PROMPTS, GREEDY)
    ours, llm = _generate(llama_dir, PROMPTS, GREEDY, speculative_config=spec)
    assert ours == plain
    stats = llm.engine.core.scheduler.spec_stats
    produced = sum(len(t) for t in ours)
    assert stats.acceptance_rate < 0.25  # the draft mostly disagrees, so rounds are paused:
    assert stats.num_drafts < produced / 3, (stats, produced)


def test_structured_requests_do_not_draft(llama_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model=str(llama_dir), dtype="float32", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["yes", "no"]})
    out = llm.generate([PROMPTS[0]], params)[0]
    assert out.outputs[0].text in ("yes", "no")
    assert llm.engine.core.scheduler.spec_stats.num_drafts == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2, "model": "/"}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "/"}, "has no config.json"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/"}, "ngram method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft checkpoint"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nope"}, "does not exist"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "<=",
        ),
    ],
)
def test_bad_speculative_configs_are_named(llama_dir: Path, spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=str(llama_dir), speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    wide = build_checkpoint(tmp_path / "wide", "llama", vocab_size=1024)
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(wide)}
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(model=str(llama_dir), speculative_config=spec)


def test_flag_json_errors_name_the_field() -> None:
    from services.engine.core.spec_config import SpeculativeConfig

    with pytest.raises(ValueError, match="--speculative-config: not JSON"):
        SpeculativeConfig.from_json("{method: ngram")
    with pytest.raises(ValueError, match="--speculative-config: num_speculative_tokens"):
        SpeculativeConfig.from_json('{"method": "ngram"}')
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.lookahead) == (2, 5, 0)


def test_smollm2_with_its_first_layers_as_draft(tmp_path_factory) -> None:
    """Real weights: SmolLM2-135M (fp32) drafted by its own first 8 of 30 layers and head, and by n-gram
    lookup on a prompt it repeats: greedy output is token-identical to plain decoding."""
    from services.engine.worker.loader.default_model import ensure_default_model

    folder = ensure_default_model()
    draft = truncated_checkpoint(folder, tmp_path_factory.getbasetemp() / "smollm2-8layers", 8)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, max_model_len=512)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [llm.tokenizer.encode(p) for p in ("Once upon a time", f"Repeat: {text}\n")]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    for spec in (
        {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)},
        {"method": "ngram", "num_speculative_tokens": 4},
    ):
        ours, llm = _generate(
            folder, prompts, params, num_kv_blocks=64, max_model_len=512, speculative_config=spec
        )
        assert ours == plain, spec["method"]
        stats = llm.engine.core.scheduler.spec_stats
        assert stats.num_drafts > 0, spec["method"]
        if spec["method"] == "ngram":  # (an untrained truncation drafts poorly: ~5% accepted here)
            assert stats.acceptance_rate > 0.2


def test_eagle_head_drafts_what_eagle_computes(llama_dir: Path, tmp_path_factory) -> None:
    """Our EAGLE proposer (paged KV, incremental) drafts the tokens EAGLE-1's math gives when computed
    from scratch with HF transformers' layers, on a random head."""
    from services.engine.llm_engine import LLMEngine
    from tests.checkpoints import eagle_reference_drafts

    head = build_eagle_head(llama_dir, tmp_path_factory.getbasetemp() / "eagle-head")
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(head), "min_acceptance": 0}
    from services.engine.core.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", speculative_config=spec))
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), "r")
    engine.step()  # the prefill samples t1; the head drafts from the prompt's features
    req = engine.core.scheduler.requests["r"]
    assert req.spec_token_ids == eagle_reference_drafts(llama_dir, head, req.all_token_ids, 3)


def test_draft_kv_follows_the_prefix_cache(llama_dir: Path) -> None:
    """A request that never drafted (max_tokens=1) leaves prefix-cache blocks without draft KV; a later
    request hitting them must not trust them (the target as its own draft then still accepts all)."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=128, block_size=4, speculative_config=spec)
    prefix = list(range(30, 70))
    llm.generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1))
    out = llm.generate([prefix + [2, 3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert out.num_cached_tokens >= 36  # the shared prefix came from the cache
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 10 and stats.acceptance_rate == 1.0
    llm.generate([prefix + [2, 3, 4]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.engine.core.scheduler.spec_stats.acceptance_rate == 1.0  # now the blocks hold draft KV too
