"""SSE: OpenAI's exact framing, and a parser that is indifferent to how the bytes are split."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from services.common.openai.protocol import StreamContext
from services.common.openai.sse import (
    SSE_DONE,
    SSEEvent,
    SSEParser,
    aiter_sse,
    iter_sse,
    parse_sse,
    sse_event,
)


def test_sse_event_framing() -> None:
    assert sse_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert sse_event("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert sse_event("two\nlines") == b"data: two\ndata: lines\n\n"


def test_sse_event_of_a_model_is_compact_json() -> None:
    chunk = StreamContext("completion", "m", id="cmpl-1", created=5).completion_chunk(0, "hi")
    raw = sse_event(chunk)
    assert raw.startswith(b'data: {"id":"cmpl-1","object":"text_completion","created":5,')
    assert raw.endswith(b"}\n\n") and raw.count(b"\n") == 2


def test_parse_openai_stream() -> None:
    raw = sse_event({"n": 1}) + b": keep-alive comment\n\n" + sse_event({"n": 2}) + SSE_DONE
    events = parse_sse(raw)
    assert [e.json() for e in events[:2]] == [{"n": 1}, {"n": 2}]
    assert events[2].is_done and not events[0].is_done
    assert len(events) == 3


def test_parse_fields_line_endings_and_multiline() -> None:
    raw = (
        b"event: ping\r\nid: 7\r\nretry: 100\r\ndata: a\r\ndata:b\r\rdata: c\n\ndata: tail-without-blank-line"
    )
    events = parse_sse(raw)
    assert events == [
        SSEEvent(data="a\nb", event="ping", id="7", retry=100),
        SSEEvent(data="c", id="7", retry=100),
    ]


def test_event_without_data_is_not_dispatched() -> None:
    assert parse_sse(b"event: x\n\nid: 3\n\n") == []


RAW = b"".join(
    [sse_event({"i": i, "text": "ü\r" * i}) for i in range(5)] + [b"data: x\r\n\r\n", b":c\r\r", SSE_DONE]
)


@given(st.lists(st.integers(min_value=0, max_value=len(RAW)), max_size=12))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(RAW)]
    pieces = [RAW[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert list(iter_sse(pieces)) == parse_sse(RAW)


def test_byte_by_byte_split_keeps_utf8_and_crlf() -> None:
    parser = SSEParser()
    events = [e for i in range(len(RAW)) for e in parser.feed(RAW[i : i + 1])] + parser.close()
    assert events == parse_sse(RAW)
    assert events[3].json()["text"] == "ü\r" * 3
    assert events[-1].is_done


def test_aiter_sse() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(RAW), 7):
            yield RAW[i : i + 7]

    async def collect() -> list[SSEEvent]:
        return [event async for event in aiter_sse(chunks())]

    assert asyncio.run(collect()) == parse_sse(RAW)


def test_splitlines_line_ends_leave_as_json_escapes() -> None:
    """U+0085/U+2028/U+2029 end lines for str.splitlines (httpx's aiter_lines): a random model's text held
    one and cut a soak client's event in two. Escaped, the event is one line and decodes to the same text."""
    text = "a\x85b\u2028c\u2029d"
    for payload in ({"t": text}, json.dumps({"t": text}, ensure_ascii=False)):
        raw = sse_event(payload)
        assert raw.decode().splitlines() == [raw.decode().removesuffix("\n\n"), ""]  # one data line
        assert parse_sse(raw)[0].json() == {"t": text}
