"""Reasoning parsers: ``<think>`` outputs of DeepSeek-R1 and Qwen3, parse == stream, end detection."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ContentDelta,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    get_reasoning_parser,
)
from services.common.openai.tool_parsers import HermesToolParser

R1 = [
    # (id, text, reasoning, content): the template put "<think>\n" into the prompt
    (
        "template-opened",
        "Okay, the user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2+2. That is 4.",
        "The answer is **4**.",
    ),
    ("model-opened", "<think>\nHmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    ("truncated", "Let me think about this carefully", "Let me think about this carefully", None),
    ("end-tag-cut-off", "Reasoning… </thi", "Reasoning… </thi", None),
    ("empty-reasoning", "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    ("later-think-is-content", "a</think>b <think>c</think>", "a", "b <think>c</think>"),
    ("unicode", "让我想想… 2+2=4。\n</think>\n\n答案是 4。", "让我想想… 2+2=4。", "答案是 4。"),
    ("no-content-yet", "Step 1.\n</think>\n\n", "Step 1.", None),
]
QWEN3 = [
    (
        "thinking",
        "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?",
        "The user greets me. I should greet back.",
        "Hello! How can I help?",
    ),
    ("no-tags", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("no-tags-leading-newlines", "\n\nHello", None, "\n\nHello"),
    ("truncated-thinking", "<think>\nLet me", "Let me", None),
    ("start-tag-cut-off", "<thi", None, "<thi"),
    ("stray-end-tag", "Answer</think> more", None, "Answer</think> more"),
    ("empty-think", "<think></think>Hi", None, "Hi"),
    (
        "think-then-tool-call",
        '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "Need the weather.",
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    ),
]
CASES = [("deepseek_r1", *c) for c in R1] + [("qwen3", *c) for c in QWEN3]
IDS = [f"{c[0]}-{c[1]}" for c in CASES]


def _stream(name: str, chunks: list[str]) -> tuple[str | None, str | None]:
    stream = get_reasoning_parser(name)().stream()
    events = [event for chunk in chunks for event in stream.feed(chunk)] + stream.finish()
    assert all(event.text for event in events)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert stream.result() == (reasoning or None, content or None)
    return reasoning if reasoning.strip() else None, content if content.strip() else None


@pytest.mark.parametrize(("name", "_id", "text", "reasoning", "content"), CASES, ids=IDS)
def test_parse(name: str, _id: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert get_reasoning_parser(name)().parse(text) == (reasoning, content)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 10_000])
@pytest.mark.parametrize(("name", "_id", "text", "reasoning", "content"), CASES, ids=IDS)
def test_stream_fixed_chunks(
    name: str, _id: str, text: str, reasoning: str | None, content: str | None, size: int
) -> None:
    assert _stream(name, [text[i : i + size] for i in range(0, len(text), size)]) == (reasoning, content)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize(("name", "_id", "text", "reasoning", "content"), CASES, ids=IDS)
def test_stream_random_chunks(
    name: str, _id: str, text: str, reasoning: str | None, content: str | None, data: st.DataObject
) -> None:
    bounds = [0, *sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12))), len(text)]
    assert _stream(name, [text[a:b] for a, b in itertools.pairwise(bounds)]) == (reasoning, content)


def test_partial_end_tag_is_held_back_until_decided() -> None:
    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("2+2=4 </th") == [ReasoningDelta("2+2=4")]
    assert not stream.reasoning_ended
    assert stream.feed("ink>\n\nFour") == [ContentDelta("Four")]
    assert stream.reasoning_ended
    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("a </t") == [ReasoningDelta("a")]
    assert stream.feed("able> c") == [ReasoningDelta(" </table> c")]


def test_qwen3_decides_content_as_soon_as_the_start_tag_is_ruled_out() -> None:
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<th") == []
    assert stream.feed("is") == [ContentDelta("<this")]
    assert stream.reasoning_ended


def test_reasoning_ended_at_start_makes_everything_content() -> None:
    text = "Okay.\n</think>\n\nHi"
    assert DeepSeekR1ReasoningParser().parse(text, reasoning_ended=True) == (None, text)


@pytest.mark.parametrize(
    ("name", "text", "ended"),
    [
        ("deepseek_r1", "", False),
        ("deepseek_r1", "Hmm, the user", False),
        ("deepseek_r1", "Hmm.</think>", True),
        ("qwen3", "", False),
        ("qwen3", "<th", False),
        ("qwen3", "<think>\nHmm", False),
        ("qwen3", "<think>\nHmm</think>", True),
        ("qwen3", "{", True),  # no thinking: the constraint applies from the first token
    ],
)
def test_is_reasoning_end(name: str, text: str, ended: bool) -> None:
    assert get_reasoning_parser(name)().is_reasoning_end(text) is ended


def test_is_reasoning_end_agrees_with_the_stream_at_every_prefix() -> None:
    for name, _id, text, _r, _c in CASES:
        parser = get_reasoning_parser(name)()
        stream = parser.stream()
        for i, char in enumerate(text):
            stream.feed(char)
            assert parser.is_reasoning_end(text[: i + 1]) is stream.reasoning_ended, (name, text[: i + 1])


def test_prompt_ends_reasoning() -> None:
    qwen3 = Qwen3ReasoningParser()
    assert qwen3.prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.prompt_ends_reasoning("<|im_start|>assistant\n")
    assert not DeepSeekR1ReasoningParser().prompt_ends_reasoning("<｜Assistant｜><think>\n")


def test_composes_with_a_tool_parser() -> None:
    text = QWEN3[-1][1]
    reasoning_stream, tool_stream = Qwen3ReasoningParser().stream(), HermesToolParser().stream(None)
    reasoning = []
    for char in text:
        for event in reasoning_stream.feed(char):
            if isinstance(event, ContentDelta):
                tool_stream.feed(event.text)
            else:
                reasoning.append(event.text)
    assert reasoning_stream.finish() == []
    tool_stream.finish()
    assert "".join(reasoning) == "Need the weather."
    assert [(c.name, c.arguments) for c in tool_stream.tool_calls] == [("get_weather", "{}")]
    assert tool_stream.result().content is None


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("o1")
