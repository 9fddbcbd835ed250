"""Reasoning parsers by ``--reasoning-parser`` name (vLLM's names), torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from services.common.openai.reasoning_parsers.base import (
    THINK_END,
    THINK_START,
    ReasoningDelta,
    ReasoningEvent,
    ReasoningParser,
    ReasoningStream,
)
from services.common.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from services.common.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from services.common.openai.tool_parsers.base import ContentDelta

REASONING_PARSERS: Mapping[str, type[ReasoningParser]] = MappingProxyType(
    {parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError listing the known names otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


__all__ = [
    "REASONING_PARSERS",
    "THINK_END",
    "THINK_START",
    "ContentDelta",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningEvent",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
