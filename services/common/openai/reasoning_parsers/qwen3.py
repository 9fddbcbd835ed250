"""Qwen3 reasoning: ``<think>reasoning</think>answer``; a completion without ``<think>`` is all content."""

from __future__ import annotations

from services.common.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the completion opens with ``<think>``; it runs to ``</think>`` or the end.

    With ``enable_thinking=False`` the template closes an empty think block in the prompt and the
    completion has no tags: it is all content (see ``prompt_ends_reasoning``).
    """

    name = "qwen3"
    implicit_start = False
