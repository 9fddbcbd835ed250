"""Structured outputs on the tiny random model: nothing but the token mask keeps its outputs valid.

Every one of 32 sampled (temperature 1) completions must validate; greedy with a constraint must be
the same after preemption, with prefix caching on/off and chunked prefill.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from services.common.openai.protocol_structured import StructuredSpec
from services.engine import LLM, SamplingParams
from tests.checkpoints import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "maxItems": 3,
        },
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "ok", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}(\.[a-z]{1,3})?"
CHOICES = ["alpha", "beta gamma", "δέλτα"]
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9] | [1-9] [0-9]'
PROMPTS = [[5, 6, 7], list(range(10, 50)), [99] * 17]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=32)


def _sampled(llm: LLM, spec: StructuredSpec, n: int = 32, max_tokens: int = 120) -> list[str]:
    params = SamplingParams(temperature=1.0, seed=7, n=n, max_tokens=max_tokens, structured_outputs=spec)
    outs = llm.generate([PROMPTS[1]], params)[0].outputs
    assert len(outs) == n
    return [o.text for o in outs]


def _grammar_text(llm: LLM, token_ids: list[int]) -> str:
    """The output's bytes as the grammar reads them: xgrammar takes an encoded surrogate (ED A0..BF xx) for
    one character where Python's decoder gives three U+FFFD, so decode with ``surrogatepass``."""
    ids = [t for t in token_ids if t not in llm.engine.core.runner.eos_ids]
    return token_bytes(llm.tokenizer, ids).decode("utf-8", errors="surrogatepass")


def test_json_schema_every_sample_validates(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=7, n=32, max_tokens=200, structured_outputs=StructuredSpec.of("json", SCHEMA)
    )
    for out in llm.generate([PROMPTS[1]], params)[0].outputs:
        jsonschema.validate(json.loads(_grammar_text(llm, out.token_ids)), SCHEMA)


def test_regex_choice_and_ebnf_every_sample_matches(llm: LLM) -> None:
    assert all(re.fullmatch(REGEX, t) for t in _sampled(llm, StructuredSpec.of("regex", REGEX))), "regex"
    assert all(t in CHOICES for t in _sampled(llm, StructuredSpec.of("choice", CHOICES))), "choice"
    for text in _sampled(llm, StructuredSpec.of("grammar", EBNF), max_tokens=60):
        assert re.fullmatch(r"\((\d{1,2}\+)*\d{1,2}\)", text), text


def test_json_object_and_vllm_style_params(llm: LLM) -> None:
    spec = StructuredSpec(kind="json_object")
    params = SamplingParams(temperature=1.0, seed=7, n=8, max_tokens=400, structured_outputs=spec)
    outs = llm.generate([PROMPTS[1]], params)[0].outputs
    finished = [o for o in outs if o.finish_reason == "stop"]  # a random model may ramble past 400 tokens
    assert finished
    for out in finished:
        assert isinstance(json.loads(_grammar_text(llm, out.token_ids)), dict) or pytest.fail(out.text)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["yes", "no"]})
    assert llm.generate([PROMPTS[0]], params)[0].outputs[0].text in ("yes", "no")


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(
        temperature=0, max_tokens=200, structured_outputs=StructuredSpec.of("json", SCHEMA)
    )
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_greedy_constraint_survives_preemption_chunking_and_prefix_caching(llama_dir: Path, llm: LLM) -> None:
    expected = _greedy(llm)
    for text in (llm.tokenizer.decode(ids) for ids in expected):
        jsonschema.validate(json.loads(text), SCHEMA)
    variants = {
        "chunked": {"max_num_batched_tokens": 7},
        "no prefix cache": {"enable_prefix_caching": False},
        "preempted": {"num_kv_blocks": 10, "block_size": 16, "max_model_len": 160},
    }
    for name, kw in variants.items():
        other = LLM(model=str(llama_dir), dtype="float32", **{"num_kv_blocks": 256, **kw})
        assert _greedy(other) == expected, name
        if name == "preempted":
            assert other.engine.core.scheduler.num_preemptions > 0
    assert _greedy(llm) == expected  # again, now with every prompt's prefix in the cache


def test_bad_grammar_fails_the_request_not_the_engine(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=StructuredSpec.of("regex", "(unclosed")
    )
    out = llm.generate([PROMPTS[0]], params)[0]
    assert out.outputs[0].finish_reason == "error" and "regex" in (out.error or "")
    ok = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(ok.outputs[0].token_ids) == 3
