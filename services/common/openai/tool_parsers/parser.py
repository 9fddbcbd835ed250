"""The tool-parser base: a format's three hooks and the incremental engine every format shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar

from services.common.openai.tool_parsers.base import (
    ContentDelta,
    ParsedMessage,
    RegionFailure,
    RegionResult,
    ScanMemo,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    known_tool_names,
    random_call_id,
)


class ToolParser(ABC):
    """One model family's tool-call format; stateless, so one instance serves every request.

    A format describes *regions* (the markup of one or more calls) through three hooks; the shared
    :class:`ToolCallStream` does the rest, so ``parse`` is exactly a stream fed the whole text.
    Whitespace right around a recognised region belongs to the markup.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    """Marker strings the format relies on: the detokenized text must keep them, so decode with
    ``skip_special_tokens=False`` where the tokenizer marks any of them special."""

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        self._id_factory = id_factory if id_factory is not None else self.default_call_id

    def default_call_id(self) -> str:
        """A fresh id for a call (``call_`` + 24 alphanumerics unless a format needs another)."""
        return random_call_id()

    def new_call_id(self) -> str:
        """The id of the next call (from the factory given at construction)."""
        return self._id_factory()

    @abstractmethod
    def find_start(self, text: str, at_message_start: bool) -> tuple[int, bool] | None:
        """Earliest index where a region starts (True) or may start once more text comes (False).

        None when no region can start anywhere in ``text``; ``at_message_start`` is true while
        nothing but whitespace precedes ``text`` in the message.
        """

    @abstractmethod
    def find_end(self, region: str, memo: ScanMemo) -> int | None:
        """Index just past the region that opens ``region``; None while it is still open.

        ``region`` only grows between calls for one region; ``memo`` is that region's scan cache.
        """

    @abstractmethod
    def parse_region(self, region: str, tools: frozenset[str] | None, complete: bool) -> RegionResult:
        """The calls in one region (``complete`` is false for a region cut off by the end of text)."""

    def stream(self, tools: Iterable[ToolSpec] | None = None) -> ToolCallStream:
        """An incremental parser for one choice of one request."""
        return ToolCallStream(self, known_tool_names(tools))

    def parse(self, text: str, tools: Iterable[ToolSpec] | None = None) -> ParsedMessage:
        """Split a whole completion into content and tool calls."""
        stream = self.stream(tools)
        stream.feed(text)
        stream.finish()
        return stream.result()


class ToolCallStream:
    """Feed a choice's text deltas, get content and tool-call deltas; see :class:`ToolParser`.

    A call is emitted (header, then its arguments) once its markup is complete and valid, so the
    stream never announces a call that the non-streaming parse would reject.
    """

    def __init__(self, parser: ToolParser, tools: frozenset[str] | None) -> None:
        self._parser = parser
        self._tools = tools
        self._buf = ""
        self._in_region = False
        self._memo = ScanMemo()
        self._held_ws = ""  # whitespace before the open region: content again if the region fails
        self._after_call = False  # whitespace right after a call is markup
        self._at_start = True
        self._finished = False
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._failures: list[str] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls emitted so far."""
        return list(self._calls)

    @property
    def failures(self) -> list[str]:
        """Why each region kept as content was not a valid call, so far."""
        return list(self._failures)

    def feed(self, delta: str) -> list[StreamEvent]:
        """Take the next piece of text; return what is decided now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[StreamEvent]:
        """End of the choice: everything still held back is decided (an open region fails)."""
        if self._finished:
            return []
        events = self._advance(final=True)
        self._finished = True
        return events

    def result(self) -> ParsedMessage:
        """Content, calls and failures of everything fed so far (the whole message after finish)."""
        content = "".join(self._content)
        return ParsedMessage(content if content.strip() else None, self.tool_calls, self.failures)

    def _advance(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buf:
            if self._in_region:
                end = self._parser.find_end(self._buf, self._memo)
                if end is None and not final:
                    break
                cut = len(self._buf) if end is None else max(end, 1)
                region, self._buf = self._buf[:cut], self._buf[cut:]
                self._in_region = False
                events.extend(self._close(region, complete=end is not None))
                continue
            hit = self._parser.find_start(self._buf, self._at_start)
            if hit is not None and hit[1]:
                before = self._buf[: hit[0]]
                body = before.rstrip()
                events.extend(self._emit(body))
                self._held_ws = before[len(body) :]
                self._buf = self._buf[hit[0] :]
                self._in_region = True
                self._memo = ScanMemo()
                continue
            decided = self._buf if hit is None or final else self._buf[: hit[0]]
            if not final:
                decided = decided.rstrip()  # trailing whitespace may precede a region
            events.extend(self._emit(decided))
            self._buf = self._buf[len(decided) :]
            break
        return events

    def _emit(self, text: str) -> list[StreamEvent]:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return []
        self._after_call = False
        self._at_start = False
        self._content.append(text)
        return [ContentDelta(text)]

    def _close(self, region: str, complete: bool) -> list[StreamEvent]:
        result = self._parser.parse_region(region, self._tools, complete)
        if not isinstance(result, tuple):
            if isinstance(result, RegionFailure):
                self._failures.append(f"{self._parser.name}: {result.reason}")
            raw, self._held_ws = self._held_ws + region, ""
            return self._emit(raw)
        self._held_ws = ""
        self._after_call = True
        self._at_start = False
        events: list[StreamEvent] = []
        for spec in result:
            call = ToolCall(self._parser.new_call_id(), spec.name, spec.arguments)
            index = len(self._calls)
            self._calls.append(call)
            events.append(ToolCallDelta(index, id=call.id, name=call.name))
            events.append(ToolCallDelta(index, arguments=call.arguments))
        return events
