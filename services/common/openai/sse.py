"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` chunks ending in ``data: [DONE]``.

Formatting is what engines and the router send; the incremental parser (WHATWG event-stream
rules: ``\\n``, ``\\r\\n`` or ``\\r`` line ends, ``:`` comments, multi-line ``data``) is what the
router and the load generator read with.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

DONE = "[DONE]"
SSE_DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream"

_LINE_END = re.compile(rb"\r\n|\r|\n")
# Line ends to str.splitlines (and so to httpx's aiter_lines and similar consumers) that JSON may carry
# unescaped inside strings; SSE only ends lines at CR/LF, but escaping them costs nothing and keeps such
# readers from cutting an event in two (a random-weight model emits them; the soak found it).
_SPLITLINES_ONLY = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse_event(payload: BaseModel | Mapping[str, Any] | str) -> bytes:
    """One ``data:`` event; models and dicts become compact JSON, as OpenAI sends them.

    U+0085, U+2028 and U+2029 leave as JSON escapes (they can only occur inside JSON strings, so the
    document means the same); a ``str`` payload is escaped the same way when it is JSON."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json().translate(_SPLITLINES_ONLY)
    elif isinstance(payload, str):
        text = payload.translate(_SPLITLINES_ONLY) if payload.startswith(("{", "[")) else payload
    else:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).translate(_SPLITLINES_ONLY)
    lines = text.split("\n")
    return "".join(f"data: {line}\n" for line in lines).encode("utf-8") + b"\n"


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event."""

    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None

    @property
    def is_done(self) -> bool:
        """True for OpenAI's end-of-stream marker ``data: [DONE]``."""
        return self.data == DONE

    def json(self) -> Any:
        """The data decoded as JSON."""
        return json.loads(self.data)


class SSEParser:
    """Incremental parser: ``feed`` bytes as they arrive, get the events completed so far."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume ``chunk``; return the events whose terminating blank line it completed."""
        self._buffer += chunk
        events: list[SSEEvent] = []
        while match := _LINE_END.search(self._buffer):
            if match.group() == b"\r" and match.end() == len(self._buffer):
                break  # may be the first half of a \r\n split across chunks
            line = self._buffer[: match.start()].decode("utf-8")
            self._buffer = self._buffer[match.end() :]
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a pending ``\\r`` ends its line; an event without a blank line is dropped."""
        if self._buffer.endswith(b"\r"):
            self._process_line(self._buffer[:-1].decode("utf-8"))
        self._buffer = b""
        return []

    def _process_line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event, self._data, self._event = self._data, self._event, [], None
        if not data:
            return None
        return SSEEvent(data="\n".join(data), event=event, id=self._id, retry=self._retry)


def parse_sse(raw: bytes) -> list[SSEEvent]:
    """All complete events of a whole SSE body."""
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


def iter_sse(chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
    """Events from a synchronous byte stream (e.g. ``httpx.Response.iter_bytes()``)."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """Events from an async byte stream (e.g. ``httpx.Response.aiter_bytes()``)."""
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
    for event in parser.close():
        yield event
