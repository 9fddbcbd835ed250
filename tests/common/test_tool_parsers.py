"""Tool-call parsers: model outputs per format, parse == stream under any chunking, delta shapes."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.openai.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    HermesToolParser,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    known_tool_names,
)
from tests.common.tool_call_outputs import (
    CASES,
    IDS,
    LLAMA_TIME,
    LLAMA_WEATHER,
    PARIS,
    TOOLS,
    Case,
    hermes_block,
)


def _text(name: str, case_id: str) -> str:
    return next(case.text for parser, case in CASES if (parser, case.id) == (name, case_id))


def _parser(name: str) -> ToolParser:
    counter = itertools.count()
    return get_tool_parser(name)(id_factory=lambda: f"id{next(counter)}")


def _stream(name: str, chunks: list[str]) -> tuple[ParsedMessage, ParsedMessage]:
    """Feed the chunks; return what the deltas add up to, and the stream's own result."""
    stream = _parser(name).stream(TOOLS)
    events = [event for chunk in chunks for event in stream.feed(chunk)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[dict[str, str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            continue
        assert isinstance(event, ToolCallDelta)
        if event.id is not None:  # the header: id + name first, no arguments
            assert event.index == len(calls) and event.name and event.arguments is None
            assert event.to_openai() == {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name},
            }
            calls.append({"id": event.id, "name": event.name, "arguments": ""})
        else:
            assert event.name is None and event.arguments is not None and event.index == len(calls) - 1
            assert event.to_openai() == {"index": event.index, "function": {"arguments": event.arguments}}
            calls[event.index]["arguments"] += event.arguments
    added = ParsedMessage(
        content if content.strip() else None, [ToolCall(**call) for call in calls], stream.failures
    )
    return added, stream.result()


def _check_stream(name: str, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    expected = _parser(name).parse(text, TOOLS)
    added, result = _stream(name, chunks)
    assert added == expected
    assert result == expected


@pytest.mark.parametrize(("name", "case"), CASES, ids=IDS)
def test_parse(name: str, case: Case) -> None:
    parsed = _parser(name).parse(case.text, TOOLS)
    assert parsed.content == case.content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == list(case.calls)
    assert len(parsed.failures) == case.failures, parsed.failures
    assert all(failure.startswith(f"{name}: ") for failure in parsed.failures)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
@pytest.mark.parametrize(("name", "case"), CASES, ids=IDS)
def test_stream_equals_parse_fixed_chunks(name: str, case: Case, size: int) -> None:
    _check_stream(name, case.text, [case.text[i : i + size] for i in range(0, len(case.text), size)])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize(("name", "case"), CASES, ids=IDS)
def test_stream_equals_parse_random_chunks(name: str, case: Case, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(case.text)), max_size=16)))
    bounds = [0, *cuts, len(case.text)]
    _check_stream(name, case.text, [case.text[a:b] for a, b in itertools.pairwise(bounds)])


def test_content_streams_before_the_call_and_holds_back_a_partial_marker() -> None:
    stream = HermesToolParser().stream(TOOLS)
    assert stream.feed("I'll check. <tool") == [ContentDelta("I'll check.")]
    assert stream.feed('_call>\n{"name": "get_weather", ') == []
    events = stream.feed('"arguments": {"city": "Paris"}}\n</tool_call>')
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]  # before finish()
    assert events[1].arguments == PARIS
    assert stream.feed("\n") == [] and stream.finish() == []
    stream = HermesToolParser().stream(TOOLS)
    assert stream.feed("3 <") == [ContentDelta("3")]
    assert stream.feed(" 4") == [ContentDelta(" < 4")]


@pytest.mark.parametrize(
    ("name", "text", "calls"),
    [
        ("hermes", _text("hermes", "qwen-parallel"), 2),
        ("hermes", hermes_block("get_time", "{}") + "\nX", 1),
        ("llama3_json", f"{LLAMA_WEATHER}; {LLAMA_TIME}\nX", 2),  # a chain ends at a char that is not ";"
        ("mistral", _text("mistral", "v3-parallel"), 2),
        ("mistral", _text("mistral", "v11-parallel"), 2),
        ("pythonic", '[get_weather(city="Paris"), get_time()]', 2),
        ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', 1),
    ],
)
def test_calls_are_emitted_as_soon_as_their_markup_closes(name: str, text: str, calls: int) -> None:
    stream = _parser(name).stream(TOOLS)
    events = [event for char in text for event in stream.feed(char)]
    assert sum(isinstance(e, ToolCallDelta) and e.arguments is not None for e in events) == calls
    assert not any(isinstance(e, ToolCallDelta) for e in stream.finish())


@pytest.mark.parametrize(
    ("name", "template"),
    [
        ("hermes", '<tool_call>\n{"name": "create_event", "arguments": {"note": "%s"}}\n</tool_call>'),
        ("llama3_json", '{"name": "create_event", "parameters": {"note": "%s"}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "create_event", "arguments": {"note": "%s"}}]'),
        ("pythonic", '[create_event(note="%s")]'),
    ],
)
def test_long_arguments_streamed_in_token_sized_chunks(name: str, template: str) -> None:
    note = 'say \\"hi\\" {[(' * 3000  # escapes and brackets inside the string, 50k characters
    text = template % note
    _check_stream(name, text, [text[i : i + 3] for i in range(0, len(text), 3)])
    (call,) = _parser(name).parse(text, TOOLS).tool_calls
    assert call.arguments == '{"note":"' + 'say \\"hi\\" {[(' * 3000 + '"}'


def test_default_ids_are_openai_shaped_and_mistral_ids_have_nine_chars() -> None:
    calls = HermesToolParser().parse(_text("hermes", "qwen-parallel"), TOOLS).tool_calls
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) for call in calls)
    assert calls[0].id != calls[1].id
    mistral = get_tool_parser("mistral")().parse(_text("mistral", "v3-parallel"), TOOLS).tool_calls
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in mistral)
    assert calls[0].to_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": PARIS},
    }


def test_tool_names_none_means_unchecked_and_empty_means_none_allowed() -> None:
    text = hermes_block("anything", "{}")
    assert [c.name for c in HermesToolParser().parse(text, None).tool_calls] == ["anything"]
    assert HermesToolParser().parse(text, []).failures == ["hermes: unknown tool 'anything'"]
    assert known_tool_names([{"type": "function", "function": {"name": "a"}}, {"name": "b"}]) == {"a", "b"}


def test_feed_after_finish_raises() -> None:
    stream = HermesToolParser().stream(TOOLS)
    stream.finish()
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("x")


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    assert get_tool_parser("hermes") is HermesToolParser
    assert all(parser.markers and parser.name == name for name, parser in TOOL_PARSERS.items())
    with pytest.raises(TypeError):
        TOOL_PARSERS["x"] = HermesToolParser  # type: ignore[index]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen")
