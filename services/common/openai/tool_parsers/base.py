"""Shared types of the tool-call parsers: calls, parsed messages, stream events, region results."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

ToolSpec: TypeAlias = Mapping[str, object]
"""One entry of a request's ``tools``: ``{"type": "function", "function": {"name", "parameters"?}}``."""

_ALPHANUMERIC = string.ascii_letters + string.digits


def random_call_id(prefix: str = "call_", length: int = 24) -> str:
    """A tool-call id as vLLM and OpenAI make them: ``call_`` + 24 random alphanumerics."""
    return prefix + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def known_tool_names(tools: Iterable[ToolSpec] | None) -> frozenset[str] | None:
    """The function names a request declares; None (no check) when the request passes no list."""
    if tools is None:
        return None
    names: set[str] = set()
    for tool in tools:
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def arguments_json(arguments: Mapping[str, object]) -> str:
    """The ``function.arguments`` string: compact JSON, non-ASCII kept as is."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON string of the arguments object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, object]:
        """The call as OpenAI's ``message.tool_calls[i]``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedMessage:
    """A whole completion split into content and calls; ``failures`` names markup kept as content."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    """Text that is certainly not tool-call (or reasoning) markup."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One ``delta.tool_calls[i]`` piece: the header (id + name) first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, object]:
        """The piece as OpenAI streams it in ``choices[].delta.tool_calls``."""
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, str] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


StreamEvent: TypeAlias = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class CallSpec:
    """A call a format parser recognised, before it gets an id."""

    name: str
    arguments: str


@dataclass(frozen=True)
class RegionFailure:
    """Markup that meant to be a call but is not a valid one (kept as content, counted)."""

    reason: str


@dataclass(frozen=True)
class NotACall:
    """Text that only looked like the start of a call (plain content, not a failure)."""


RegionResult: TypeAlias = tuple[CallSpec, ...] | RegionFailure | NotACall


@dataclass
class ScanProgress:
    """How far a bracket scan of one value got: where to resume, at what depth, inside which
    string quote, or where the value ended."""

    resume: int
    depth: int = 0
    quote: str | None = None
    end: int | None = None


class ScanMemo:
    """Per-region scan progress, so ``find_end`` resumes where it stopped (streaming stays linear)."""

    def __init__(self) -> None:
        self._progress: dict[int, ScanProgress] = {}
        self._searched: dict[tuple[str, int], int] = {}

    def progress(self, start: int) -> ScanProgress:
        """The progress of the scan of the value that opens at ``start``."""
        return self._progress.setdefault(start, ScanProgress(start))

    def find(self, text: str, marker: str, start: int) -> int:
        """``text.find(marker, start)`` that does not search again what an earlier call searched."""
        key = (marker, start)
        found = text.find(marker, self._searched.get(key, start))
        if found < 0:
            self._searched[key] = max(start, len(text) - len(marker) + 1)
        else:
            self._searched[key] = found
        return found
