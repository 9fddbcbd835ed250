"""Through the router: output constraints, enforced tool calls, reasoning and /v1/embeddings (the router
applies the chat template and shapes chat messages itself; engines in-process, the router a real process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.entrypoints.test_embeddings import TEXTS, _minilm
from tests.engine.entrypoints.test_tools import ASK, TEMPLATE, TIME, WEATHER
from tests.engine_harness import InProcessEngine, start_in_process
from tests.router.stack import RouterProcess, start_router

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def generator(llama_dir: Path) -> Iterator[InProcessEngine]:
    e = start_in_process(llama_dir, "--max-model-len", "1024")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def router(
    llama_dir: Path, generator: InProcessEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    r = start_router(
        llama_dir,
        tmp_path_factory.mktemp("router-logs"),
        [generator.url],
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield r
    r.stop()


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_constraints_pass_through_the_router(router: RouterProcess) -> None:
    oai = _oai(router.url)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for stream in (False, True):
        if stream:
            chunks = oai.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, response_format=fmt, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = (
                oai.chat.completions.create(
                    model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, response_format=fmt
                )
                .choices[0]
                .message.content
            )
        jsonschema.validate(json.loads(text), SCHEMA)
    cmpl = oai.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_choice": ["a", "b"]}
    )
    assert cmpl.choices[0].text in ("a", "b")


def test_enforced_tool_calls_through_the_router(router: RouterProcess) -> None:
    out = _oai(router.url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=120,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    stream = _oai(router.url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=120,
        stream=True,
    )
    args, finish = "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or ():
            args += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_embeddings_through_the_router(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    embedder = start_in_process(_minilm())
    r = start_router(_minilm(), tmp_path, [embedder.url])
    try:
        out = _oai(r.url).embeddings.create(model=MODEL, input=TEXTS)
        ref = SentenceTransformer(str(_minilm()), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
        got = torch.tensor([d.embedding for d in out.data])
        assert bool((torch.nn.functional.cosine_similarity(got, ref, dim=-1) >= 0.9999).all())
        assert out.model == MODEL and out.usage.prompt_tokens > 0
    finally:
        r.stop()
        embedder.stop()
