"""Tool calling and reasoning through the official openai client: enforced (required / named) on the random
model, parsed (auto) from scripted model text, streamed as OpenAI tool_call deltas; bad input as 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.engine.entrypoints.helpers import MODEL
from tests.engine.scripted_model import ScriptedLM
from tests.engine_harness import InProcessEngine, start_in_process

TEMPLATE = Path(__file__).resolve().parents[2] / "fixtures" / "hermes_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _scripted(llama_dir: Path, *flags: str) -> InProcessEngine:
    e = start_in_process(
        llama_dir,
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "1024",
        *flags,
    )
    scripted = ScriptedLM(e.ctx.llm.engine.core.runner.model)
    e.ctx.llm.engine.core.runner.model = scripted
    e.scripted = scripted  # type: ignore[attr-defined]
    return e


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[InProcessEngine]:
    e = _scripted(llama_dir)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def thinker(llama_dir: Path) -> Iterator[InProcessEngine]:
    """A reasoning model's server: deepseek_r1 output is reasoning until </think>."""
    e = _scripted(llama_dir, "--reasoning-parser", "deepseek_r1")
    yield e
    e.stop()


def _client(e: InProcessEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{e.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(engine: InProcessEngine) -> openai.OpenAI:
    return _client(engine)


def _say(engine: InProcessEngine, text: str, eos: bool = True) -> None:
    tok = engine.ctx.llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    engine.scripted.say(ids)  # type: ignore[attr-defined]


def test_required_and_named_are_enforced_on_the_random_model(
    oai: openai.OpenAI, engine: InProcessEngine
) -> None:
    _say(engine, "", eos=False)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=1.0,
            max_tokens=120,
            n=3,
            seed=1,
            parallel_tool_calls=False,
        )
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            for call in c.message.tool_calls:
                schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"][
                    "parameters"
                ]
                jsonschema.validate(json.loads(call.function.arguments), schema)
                assert call.id.startswith("call_") and call.type == "function"
            if isinstance(choice, dict):
                assert [t.function.name for t in c.message.tool_calls] == ["get_time"]


TOOL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_auto_parses_hermes_calls_and_keeps_the_text(oai: openai.OpenAI, engine: InProcessEngine) -> None:
    _say(engine, TOOL_TEXT)
    out = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=200
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 2,
    }


def test_auto_streams_openai_tool_call_deltas(oai: openai.OpenAI, engine: InProcessEngine) -> None:
    _say(engine, TOOL_TEXT)
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=200, stream=True
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or d.id
            entry["name"] = entry["name"] or (d.function.name if d.function else None)
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_reasoning_goes_to_reasoning_content(thinker: InProcessEngine) -> None:
    oai, engine = _client(thinker), thinker
    _say(engine, "<think>The user wants a color.</think>Blue.")
    out = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=100)
    message = out.choices[0].message
    assert (
        message.content == "Blue." and message.model_extra["reasoning_content"] == "The user wants a color."
    )
    _say(engine, "<think>Thinking hard.</think>Done")
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=100, stream=True
    )
    reasoning = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("Thinking hard.", "Done")


def test_constraint_starts_after_the_reasoning(thinker: InProcessEngine) -> None:
    """The think block is free text; the JSON schema applies from </think> on."""
    oai, engine = _client(thinker), thinker
    _say(engine, "plan: pick a city</think>", eos=False)  # then the random model, masked by the schema
    out = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=1.0,
        max_tokens=150,
        seed=5,
        parallel_tool_calls=False,
    )
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "plan: pick a city"
    args = json.loads(message.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_multi_turn_with_tool_results_renders_through_the_template(engine: InProcessEngine) -> None:
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    ids = httpx.post(f"{engine.url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = engine.ctx.llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert '<tool_response id="call_1">\nsunny, 21C' in text and '"arguments": {"city": "Paris"}' in text
    _say(engine, "It is sunny.")
    out = httpx.post(
        f"{engine.url}/v1/chat/completions",
        timeout=60,
        json={"messages": history, "tools": [WEATHER], "max_tokens": 50, "temperature": 0},
    ).json()
    assert (
        out["choices"][0]["message"]["content"] == "It is sunny."
        and out["choices"][0]["finish_reason"] == "stop"
    )


BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.[0].tool_call_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tool_requests_are_400s(engine: InProcessEngine, body: dict, param: str) -> None:
    r = httpx.post(
        f"{engine.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_auto_needs_the_server_flags_and_templates_must_show_tools(llama_dir: Path) -> None:
    plain = start_in_process(llama_dir)  # no --enable-auto-tool-choice; the tiny model's template drops tools
    try:
        r = httpx.post(
            f"{plain.url}/v1/chat/completions",
            timeout=30,
            json={"messages": ASK, "tools": [WEATHER], "max_tokens": 5},
        )
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        assert "does not render `tools`" in plain.log_text()
    finally:
        plain.stop()
    templated = start_in_process(llama_dir, "--chat-template", str(TEMPLATE))
    try:
        r = httpx.post(
            f"{templated.url}/v1/chat/completions",
            timeout=30,
            json={"messages": ASK, "tools": [WEATHER], "max_tokens": 5},
        )
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        ok = httpx.post(
            f"{templated.url}/v1/chat/completions",
            timeout=30,
            json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3},
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"].get("tool_calls") is None
    finally:
        templated.stop()
