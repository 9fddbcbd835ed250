"""The P/D decider: disaggregate only when the part of the prompt decode lacks is long enough."""

from __future__ import annotations


class PDDecider:
    """Prefill on a separate endpoint when ``prompt - cached on decode >= threshold`` tokens."""

    def __init__(self, threshold: int = 256) -> None:
        if threshold < 0:
            raise ValueError(f"pd threshold must be >= 0, got {threshold}")
        self.threshold = threshold

    def uncached_tokens(self, prompt_tokens: int, cached_tokens: int) -> int:
        return max(prompt_tokens - cached_tokens, 0)

    def disaggregate(self, prompt_tokens: int, cached_tokens: int) -> bool:
        return self.uncached_tokens(prompt_tokens, cached_tokens) >= self.threshold
