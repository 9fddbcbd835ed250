"""The kvferry engine: paged KV cache, prefix caching, chunked prefill, preemption (vLLM V1's design)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that pure-Python parts (scheduler, block pool) import without torch.
    if name == "LLM":
        from services.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from services.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
