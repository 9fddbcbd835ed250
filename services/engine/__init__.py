"""The kvferry engine: paged KV cache, prefix caching, chunked prefill, preemption (vLLM V1's design)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# GNU OpenMP threads that spin at barriers collapse when a core is taken by another process (a shared
# node, a CPU-limited pod): passive waits keep both cores useful. `kvferry serve` runs with Intel
# OpenMP's bounded spin instead where it is installed (see cpu_runtime.py; it sets the marker).
# Must be set before torch loads its OpenMP runtime; an explicit setting wins.
if "KVFERRY_CPU_RUNTIME_APPLIED" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from services.engine.core.sampling_params import SamplingParams
    from services.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that pure-Python parts (scheduler, block pool) import without torch.
    if name == "LLM":
        from services.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from services.engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
