"""Bad input raises a ValueError naming the field, and the engine keeps serving afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("stop", [""]),
        ("unknown_field", 1),
    ],
)
def test_invalid_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})
    assert issubclass(ValidationError, ValueError)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "prompt"),
        ([], "prompt"),
        (list(range(3, 200)), "max_model_len"),
        ([10**6], "token ids"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_running(llm: LLM, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert len(ok[0].outputs[0].token_ids) == 2
    assert llm.engine.core.kv_manager.pool.num_free_blocks == 64


def test_generation_stops_at_max_model_len(llm: LLM) -> None:
    out = llm.generate([list(range(3, 120))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(out.outputs[0].token_ids) == 128 - 117 and out.outputs[0].finish_reason == "length"


def test_incremental_detokenizer_never_splits_utf8(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    text = "über café 東京 🚀 naïve"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], ())
    pieces = []
    for t in ids:
        detok.add_tokens([t])
        piece = detok.take_delta(final=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.take_delta(final=True))
    assert "".join(pieces) == text


def test_detokenizer_holds_back_a_partial_stop_string(llama_dir: Path) -> None:
    tok = Tokenizer(llama_dir)
    ids = tok.encode("hello world the quick brown fox")
    detok = IncrementalDetokenizer(tok, [], stop=("quick brown",))
    streamed = ""
    for t in ids:
        hit = detok.add_tokens([t])
        streamed += detok.take_delta(final=False)
        assert "quick" not in streamed or hit
        if hit:
            break
    streamed += detok.take_delta(final=True)
    assert streamed == "hello world the "
