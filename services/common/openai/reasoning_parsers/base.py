"""Shared types of the reasoning parsers: reasoning deltas and the ``<think>`` stream state machine."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, TypeAlias

from services.common.openai.tool_parsers.base import ContentDelta

THINK_START = "<think>"
THINK_END = "</think>"


def _without_partial_tag(text: str, tag: str) -> str:
    """``text`` less a suffix that may be the beginning of ``tag`` (held until more text comes)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size]
    return text


class _Phase(Enum):
    START = "start"  # deciding whether the message opens with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of ``reasoning_content``."""

    text: str


ReasoningEvent: TypeAlias = ReasoningDelta | ContentDelta


class ReasoningParser:
    """``<think>...</think>`` then the answer; stateless, so one instance serves every request.

    Whitespace right around the tags belongs to the markup. Everything after the end tag is
    content (a second ``<think>`` there is content too). ``implicit_start`` says whether the
    message is reasoning from its first character even without the start tag (the chat template
    put ``<think>`` into the prompt).
    """

    name: ClassVar[str]
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END
    implicit_start: ClassVar[bool] = False

    def stream(self, *, reasoning_ended: bool = False) -> ReasoningStream:
        """An incremental parser for one choice; ``reasoning_ended``: the prompt closed the reasoning."""
        return ReasoningStream(self, reasoning_ended)

    def parse(self, text: str, *, reasoning_ended: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole completion, None for empty or blank parts."""
        stream = self.stream(reasoning_ended=reasoning_ended)
        stream.feed(text)
        stream.finish()
        return stream.result()

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the reasoning is over in ``text``, the generated text so far (content from now on)."""
        if self.end_tag in text:
            return True
        if self.implicit_start:
            return False
        head = text.lstrip()
        return bool(head) and not head.startswith(self.start_tag) and not self.start_tag.startswith(head)

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        """Whether the prompt's generation prefix already closed the reasoning (thinking turned off,
        e.g. Qwen3's ``enable_thinking=False`` appends ``<think>\\n\\n</think>\\n\\n``)."""
        return prompt.rstrip().endswith(self.end_tag)


class ReasoningStream:
    """Feed a choice's text deltas, get reasoning and content deltas.

    A suffix that may be the start of the end tag (``</thi``), and trailing whitespace of the
    reasoning, are held back until the next text decides them.
    """

    def __init__(self, parser: ReasoningParser, reasoning_ended: bool) -> None:
        self._parser = parser
        self._phase = _Phase.CONTENT if reasoning_ended else _Phase.START
        self._buf = ""
        self._fresh_reasoning = True  # strip whitespace after the start tag
        self._fresh_content = False  # strip whitespace after the end tag
        self._finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, delta: str) -> list[ReasoningEvent]:
        """Take the next piece of text; return what is decided now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[ReasoningEvent]:
        """End of the choice: whatever is held back is decided."""
        if self._finished:
            return []
        events = self._advance(final=True)
        self._finished = True
        return events

    @property
    def reasoning_ended(self) -> bool:
        """Whether the text fed so far has left the reasoning (content is being produced)."""
        return self._phase is _Phase.CONTENT

    def result(self) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of everything fed so far."""
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        return (reasoning if reasoning.strip() else None, content if content.strip() else None)

    def _advance(self, final: bool) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        while self._buf:
            if self._phase is _Phase.START:
                if not self._decide_start(final):
                    break
            elif self._phase is _Phase.REASONING:
                events.extend(self._reason(final))
                if self._phase is _Phase.REASONING:
                    break
            else:
                events.extend(self._emit_content(self._buf))
                self._buf = ""
        return events

    def _decide_start(self, final: bool) -> bool:
        head = self._buf.lstrip()
        tag = self._parser.start_tag
        if head.startswith(tag):
            self._buf = head[len(tag) :]
            self._phase = _Phase.REASONING
        elif tag.startswith(head) and not final:
            return False
        else:
            self._phase = _Phase.REASONING if self._parser.implicit_start else _Phase.CONTENT
        return True

    def _reason(self, final: bool) -> list[ReasoningEvent]:
        tag = self._parser.end_tag
        end = self._buf.find(tag)
        if end >= 0:
            events = self._emit_reasoning(self._buf[:end].rstrip())
            self._buf = self._buf[end + len(tag) :]
            self._phase = _Phase.CONTENT
            self._fresh_content = True
            return events
        if final:
            events = self._emit_reasoning(self._buf)
            self._buf = ""
            return events
        decided = _without_partial_tag(self._buf, tag).rstrip()
        self._buf = self._buf[len(decided) :]
        return self._emit_reasoning(decided)

    def _emit_reasoning(self, text: str) -> list[ReasoningEvent]:
        if self._fresh_reasoning:
            text = text.lstrip()
        if not text:
            return []
        self._fresh_reasoning = False
        self._reasoning.append(text)
        return [ReasoningDelta(text)]

    def _emit_content(self, text: str) -> list[ReasoningEvent]:
        if self._fresh_content:
            text = text.lstrip()
        if not text:
            return []
        self._fresh_content = False
        self._content.append(text)
        return [ContentDelta(text)]
