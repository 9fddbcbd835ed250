"""DeepSeek-R1 reasoning: ``reasoning</think>answer``; the chat template may already emit ``<think>``."""

from __future__ import annotations

from services.common.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning from the first character (with or without ``<think>``) up to ``</think>``.

    DeepSeek-R1 (0528 and later) and the Qwen3 "Thinking-2507" models put ``<think>`` into the
    prompt, so their completions start inside the reasoning; a completion without ``</think>``
    (cut off by max_tokens) is all reasoning.
    """

    name = "deepseek_r1"
    implicit_start = True
