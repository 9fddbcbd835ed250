"""Hermes-style calls (Qwen2.5, Qwen3, SmolLM, Hermes): ``<tool_call>{"name", "arguments"}</tool_call>``."""

from __future__ import annotations

import json

from services.common.openai.tool_parsers._scan import (
    calls_from_json,
    json_value_end,
    loads_strict,
    marker_start,
    skip_whitespace,
    strip_partial_suffix,
)
from services.common.openai.tool_parsers.base import RegionFailure, RegionResult, ScanMemo
from services.common.openai.tool_parsers.parser import ToolParser

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """One ``<tool_call>`` block per call, any number per message, text around them is content.

    The block holds one JSON object ``{"name": ..., "arguments": {...}}`` (``parameters`` is read
    too) or, as SmolLM2 writes it, a JSON list of them. A block whose closing tag is missing (a stop
    string ate it, max_tokens cut it, the model went on with text or the next ``<tool_call>``) is
    still a call when its JSON is complete; otherwise it fails.
    """

    name = "hermes"
    markers = (TOOL_CALL_START, TOOL_CALL_END)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, bool] | None:
        """A region starts at ``<tool_call>``."""
        return marker_start(text, (TOOL_CALL_START,))

    def find_end(self, region: str, memo: ScanMemo) -> int | None:
        """After the JSON and its ``</tool_call>``; a ``<tool_call>`` inside a JSON string is no marker."""
        pos = skip_whitespace(region, len(TOOL_CALL_START))
        if pos >= len(region):
            return None
        if region[pos] in "{[":
            end = json_value_end(region, pos, memo)
            if end is None:
                return None
            after = skip_whitespace(region, end)
            if region.startswith(TOOL_CALL_END, after):
                return after + len(TOOL_CALL_END)
            return None if TOOL_CALL_END.startswith(region[after:]) else end  # the tag may follow
        close = memo.find(region, TOOL_CALL_END, pos)  # not JSON: it fails up to the closing tag
        return None if close < 0 else close + len(TOOL_CALL_END)

    def parse_region(self, region: str, tools: frozenset[str] | None, complete: bool) -> RegionResult:
        """The JSON between the tags as one call or a list of calls."""
        body = region[len(TOOL_CALL_START) :].rstrip()
        closed = body.endswith(TOOL_CALL_END)
        if closed:
            body = body[: -len(TOOL_CALL_END)]
        elif not complete:
            body = strip_partial_suffix(body, TOOL_CALL_END)
        try:
            value = loads_strict(body)
        except (json.JSONDecodeError, ValueError) as exc:
            what = "invalid" if closed else "unterminated"
            return RegionFailure(f"{what} tool call JSON ({exc})")
        return calls_from_json(value, tools)
