"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``<|python_tag|>{"name", "parameters"}; {...}``."""

from __future__ import annotations

import re

from services.common.openai.tool_parsers._scan import (
    calls_from_json,
    decode_strict,
    json_value_end,
    marker_start,
    skip_whitespace,
)
from services.common.openai.tool_parsers.base import (
    CallSpec,
    NotACall,
    RegionFailure,
    RegionResult,
    ScanMemo,
)
from services.common.openai.tool_parsers.parser import ToolParser

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_CALL_LIKE = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"(?:name|type|function)"')


class Llama3JsonToolParser(ToolParser):
    """JSON call objects at the start of the message or after ``<|python_tag|>``, ``;``-separated.

    Llama writes ``{"name": ..., "parameters": {...}}`` (``arguments`` is read too, a ``"type":
    "function"`` key is ignored). The tag is a special token: keep special tokens in the detokenized
    text, or only the markerless form (a message that starts with ``{``) is seen. A message that
    starts with a JSON object which is not call-shaped (no ``name``) is plain content.
    """

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, bool] | None:
        """A region starts at ``<|python_tag|>`` or at a ``{`` that opens the message."""
        if at_message_start:
            stripped = text.lstrip()
            if stripped.startswith("{"):
                return len(text) - len(stripped), True
        return marker_start(text, (PYTHON_TAG,))

    def find_end(self, region: str, memo: ScanMemo) -> int | None:
        """After the last object of a ``;``-separated chain (None until the next char decides)."""
        pos = len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        while True:
            pos = skip_whitespace(region, pos)
            if pos >= len(region) or region[pos] != "{":
                return None  # not JSON after the tag: the rest of the text fails as one region
            end = json_value_end(region, pos, memo)
            if end is None:
                return None
            after = skip_whitespace(region, end)
            if after >= len(region):
                return None  # a ";" may follow
            if region[after] != SEPARATOR:
                return end
            pos = after + 1

    def parse_region(self, region: str, tools: frozenset[str] | None, complete: bool) -> RegionResult:
        """Each object of the chain as a call; a non-call JSON object opening the message is content."""
        tagged = region.startswith(PYTHON_TAG)
        call_like = tagged or _CALL_LIKE.match(region) is not None
        pos = len(PYTHON_TAG) if tagged else 0
        calls: list[CallSpec] = []
        while True:
            pos = skip_whitespace(region, pos)
            try:
                value, pos = decode_strict(region, pos)
            except ValueError as exc:
                reason = "truncated" if not complete else "invalid"
                return RegionFailure(f"{reason} tool call JSON ({exc})") if call_like else NotACall()
            if not call_like:
                return NotACall()
            result = calls_from_json(value, tools)
            if isinstance(result, RegionFailure):
                return result
            calls.extend(result)
            pos = skip_whitespace(region, pos)
            if pos < len(region) and region[pos] == SEPARATOR:
                pos = skip_whitespace(region, pos + 1)
            elif pos < len(region):
                return RegionFailure(f"unexpected text after a tool call: {region[pos : pos + 20]!r}")
            if pos >= len(region):
                return tuple(calls)
