"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from services.common.openai.tool_parsers.base import (
    ContentDelta,
    ParsedMessage,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    known_tool_names,
    random_call_id,
)
from services.common.openai.tool_parsers.hermes import HermesToolParser
from services.common.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from services.common.openai.tool_parsers.mistral import MistralToolParser
from services.common.openai.tool_parsers.parser import ToolCallStream, ToolParser
from services.common.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {
        parser.name: parser
        for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
    }
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedMessage",
    "PythonicToolParser",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolSpec",
    "get_tool_parser",
    "known_tool_names",
    "random_call_id",
]
